"""``bench load``'s table and plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from app.bench.core.slo import named_tail
from app.bench.core.stats import MOONCAKE, SIDECAR

COLUMNS = (  # (figure, header, format)
    ("ttft_p50_ms", "TTFT p50", ".0f"),
    ("ttft_p90_ms", "p90", ".0f"),
    ("ttft_p99_ms", "p99", ".0f"),
    ("handoff_ms", "handoff", ".0f"),
    ("after_p_p50_ms", "after P p50", ".0f"),
    ("after_p_p99_ms", "p99", ".0f"),
    ("layer_write_ms", "layer write", ".0f"),
    ("tpot_p50_ms", "TPOT p50", ".1f"),
    ("tpot_p90_ms", "p90", ".1f"),
    ("throughput_rps", "thr/s", ".2f"),
    ("goodput_rps", "good/s", ".2f"),
    ("attainment", "SLO met", ".0%"),
    ("d_kv_usage_max", "D KV max", ".0%"),
    ("d_waiting_max", "D wait max", ".0f"),
    ("preemptions", "preempt", ".0f"),
    ("failed_loads_est", "recomp", ".0f"),
    ("cpu_ms_per_request", "xfer cpu ms/req", ".0f"),
    ("transfer_rss_mib", "xfer RSS MiB", ".0f"),
)


def _cell(sp: dict[str, Any] | None, fmt: str) -> str:
    """median (min–max) where reps exist; '-' for none, or a figure older runs lack."""
    if sp is None or sp["n"] == 0:
        return "-"
    mid = format(sp["median"], fmt)
    return mid if sp["n"] == 1 else f"{mid} ({format(sp['min'], fmt)}–{format(sp['max'], fmt)})"


def _link_text(result: dict[str, Any]) -> str | None:
    """'a shaped link (R Mbit/s)' when the rate steps ran on one; None otherwise (and for runs
    made before the option, which were all unshaped)."""
    link = result.get("link") or {"link": "unshaped"}
    if link["link"] != "shaped":
        return None
    return f"a shaped link ({link['rate_bps'] / 1e6:.0f} Mbit/s)"


def _knee(v: float | None) -> str:
    return "none (no rate met the SLO for 90%)" if v is None else f"{v:.3g} req/s"


def interval_text(iv: dict[str, Any] | None, fmt: str = ".2f") -> str:
    """A ratio as the docs write it: 0.42 [0.38–0.47] (the bootstrap interval); '-' for none."""
    if iv is None:
        return "-"
    point = format(iv["point"], fmt)
    if iv["low"] is None or iv["high"] is None:
        return f"{point} [no interval: {iv['units']} request(s)]"
    return f"{point} [{format(iv['low'], fmt)}–{format(iv['high'], fmt)}]"


def _ms(v: float | None, fmt: str = ".0f") -> str:
    return "-" if v is None else format(v, fmt)


RATIOS = (  # (key, printed name)
    ("ttft_p50_ms", "TTFT P50"),
    ("ttft_p90_ms", "TTFT P90"),
    ("tpot_p50_ms", "TPOT P50"),
    ("handoff_ms", "handoff"),
    ("goodput_rps", "goodput"),
)


def print_rounds(rounds: dict[str, Any], console: Console) -> None:
    """The interleaved rounds' summary: per rate and system the figures over every round's
    requests; per rate the ratios kv-sidecar / peer and each system's A/A (round 2 / round 1)
    with 90% bootstrap intervals over requests; the knees; the drift between rounds."""
    table = Table(
        title="bench load, per rate and system over its rounds (ms unless noted); the tail is "
        "P99 from 100 requests, else the max"
    )
    for head in ("rate/s", "system", "n", "TTFT p50", "p90", "tail", "handoff", "TPOT p50"):
        table.add_column(head, justify="right")
    for head in ("thr/s", "good/s", "SLO met", "TTFT p50 by round"):
        table.add_column(head, justify="right")
    for r in rounds["rows"]:
        name, value = named_tail(r["ttft_p99_ms"], r["ttft_max_ms"])
        table.add_row(
            f"{r['rate']:.3g}",
            r["system"],
            str(r["n_requests"]),
            _ms(r["ttft_p50_ms"]),
            _ms(r["ttft_p90_ms"]),
            f"{name} {_ms(value)}",
            _ms(r["handoff_ms"]),
            _ms(r["tpot_p50_ms"], ".1f"),
            f"{r['throughput_rps']:.2f}",
            f"{r['goodput_rps']:.2f}",
            f"{r['attainment']:.0%}",
            " / ".join(_ms(v) for v in r["round_ttft_p50_ms"]),
        )
    console.print(table)
    for entry in rounds["per_rate"]:
        parts = [f"{n} {interval_text(entry['ratio'][k])}" for k, n in RATIOS if "ratio" in entry]
        console.print(f"{entry['rate']:.3g} req/s {SIDECAR} / {MOONCAKE}: " + ", ".join(parts))
        for system, aa in entry["aa"].items():
            parts = [f"{n} {interval_text(aa[k])}" for k, n in RATIOS]
            console.print(f"  A/A {system} (round 2 / round 1): " + ", ".join(parts))
    for system, k in rounds["knee"].items():
        console.print(f"knee {system}: {_knee(k)}")
    console.print(
        f"knee_ratio {SIDECAR} / {MOONCAKE}: {interval_text(rounds['knee_ratio'])} (90% "
        "bootstrap intervals over requests, paired: the same requests on both)"
    )
    for system, col in rounds["drift"].items():
        console.print(
            f"drift between rounds, {system} (TTFT P50 / round 1's, geometric mean over "
            "rates): " + " / ".join(_ms(v, ".2f") for v in col)
        )


def print_summary(result: dict[str, Any], console: Console) -> None:
    """Per rate and system the step's figures (ms unless noted; median (min–max) over reps),
    then each system's knee, the knee ratio and the A/A ratios; runs in interleaved rounds
    print their rounds' summary instead (``print_rounds``)."""
    summary = result["summary"]
    if "rounds" in summary:
        _preamble(result, console)
        print_rounds(summary["rounds"], console)
        console.print(result["binding"]["text"])
        return
    _preamble(result, console)
    table = Table(
        title=f"bench load ({result['binding']['regime']} cores): per rate step; handoff = "
        "TTFT − P's prefill time (mean per request); after P = P's answer back → first token, per "
        "request; recomp = prompts decode recomputed (est.)"
    )
    table.add_column("rate/s", justify="right")
    table.add_column("system")
    for _, head, _ in COLUMNS:
        table.add_column(head, justify="right")
    for row in summary["rows"]:
        cells = [_cell(row.get(f), fmt) for f, _, fmt in COLUMNS]
        table.add_row(f"{row['rate']:.3g}", row["system"], *cells)
    console.print(table)
    for system, k in summary["knee"].items():
        console.print(f"knee {system}: {_knee(k)}")
    ratio = summary["knee_ratio"]
    console.print(
        f"knee_ratio {SIDECAR} / {MOONCAKE}: " + ("-" if ratio is None else f"{ratio:.2f}")
    )
    for aa in summary["aa"] or ():
        r = aa["ratio"]
        parts = [
            f"{f} {r[f]:.2f}"
            for f in ("ttft_p90_ms", "goodput_rps", "tpot_p50_ms")
            if r.get(f) is not None
        ]
        console.print(
            f"A/A at {aa['rate']:.3g} req/s ({aa['systems'][0]} / {aa['systems'][1]}, the noise "
            f"floor): {', '.join(parts) or '-'}"
        )
    console.print(result["binding"]["text"])


def _preamble(result: dict[str, Any], console: Console) -> None:
    console.print(result["engine_dtype"]["text"])
    console.print(result["slo"]["text"])
    if (link := _link_text(result)) is not None:
        console.print(f"rate steps on {link}")
    console.print(
        f"unloaded service time {1e3 * result['service_s']:.0f} ms; rates: "
        + ", ".join(f"{r:.3g}" for r in result["rates"])
        + " req/s"
    )


def plot(result: dict[str, Any], path: Path) -> Path:
    """TTFT P90 and goodput (throughput dotted) against rate, both systems (and A/A), medians
    with min–max bars (needs the ``bench`` extra)."""
    import matplotlib

    matplotlib.use("Agg")  # no display here, and none wanted
    import matplotlib.pyplot as plt

    rows = result["summary"]["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    colors = {SIDECAR: "C0", MOONCAKE: "C3"}
    for ax, metric, title in (
        (axes[0], "ttft_p90_ms", "TTFT P90 (ms)"),
        (axes[1], "goodput_rps", "goodput (req/s meeting the SLO); dotted: throughput"),
    ):
        for system in systems:
            mine = [r for r in rows if r["system"] == system and r[metric]["n"] > 0]
            if not mine:
                continue
            x = [r["rate"] for r in mine]
            mid = [r[metric]["median"] for r in mine]
            err = [
                [m - r[metric]["min"] for r, m in zip(mine, mid, strict=True)],
                [r[metric]["max"] - m for r, m in zip(mine, mid, strict=True)],
            ]
            color = colors.get(system, "C2")
            style = "o-" if system in colors else "s"
            ax.errorbar(x, mid, yerr=err, fmt=style, color=color, capsize=3, label=system)
            if metric == "goodput_rps":
                thr = [r["throughput_rps"]["median"] for r in mine]
                ax.plot(x, thr, ":", color=color)
            knee = result["summary"]["knee"].get(system)
            if knee is not None:
                ax.axvline(knee, color=color, alpha=0.3, linestyle="--")
        ax.set_title(title)
        ax.set_xlabel("offered rate (req/s, Poisson)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ratio = result["summary"]["knee_ratio"]
    fig.suptitle(
        f"bench load, {result['binding']['regime']} cores, {result['engine_dtype']['dtype']}"
        f"{'' if (link := _link_text(result)) is None else ', ' + link}: "
        f"knee ratio {SIDECAR}/{MOONCAKE} = " + ("-" if ratio is None else f"{ratio:.2f}")
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
