"""``bench load``'s table and plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

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


def print_summary(result: dict[str, Any], console: Console) -> None:
    """Per rate and system the step's figures (ms unless noted; median (min–max) over reps),
    then each system's knee, the knee ratio and the A/A ratios."""
    summary = result["summary"]
    console.print(result["engine_dtype"]["text"])
    console.print(result["slo"]["text"])
    if (link := _link_text(result)) is not None:
        console.print(f"rate steps on {link}")
    console.print(
        f"unloaded service time {1e3 * result['service_s']:.0f} ms; rates: "
        + ", ".join(f"{r:.3g}" for r in result["rates"])
        + " req/s"
    )
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
