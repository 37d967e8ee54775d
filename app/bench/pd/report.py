"""``bench pd``'s table and plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from app.bench.core.stats import SYSTEMS


def _fmt(v: float | None, metric: str) -> str:
    if v is None:
        return "-"
    if metric == "bytes":
        return f"{v / 2**20:.2f} MiB"
    return f"{v:.2f}" if metric == "cpu_s_per_gib" else f"{v:.1f}"


def _cell(sp: dict[str, Any], metric: str) -> str:
    """median (min–max)."""
    if sp["n"] == 0:
        return "-"
    mid = _fmt(sp["median"], metric)
    return mid if sp["n"] == 1 else f"{mid} ({_fmt(sp['min'], metric)}–{_fmt(sp['max'], metric)})"


def _ratio_cell(row: dict[str, Any]) -> str:
    """A summary row's (or its A/A's) ratio [90% interval] (per-repetition min–max)."""
    ratio, sp, iv = row["ratio"], row["ratio_spread"], row.get("ratio_interval")
    if ratio is None:
        return "-"
    if sp["n"] < 2:
        return f"{ratio:.2f}"
    bounds = f" [{iv['low']:.2f}, {iv['high']:.2f}]" if iv and iv["low"] is not None else ""
    return f"{ratio:.2f}{bounds} ({sp['min']:.2f}–{sp['max']:.2f})"


def print_summary(result: dict[str, Any], console: Console) -> None:
    """Per system median (min–max) over its counted trials and n; the ratio first system /
    second of the medians (its 90% paired bootstrap interval over repetitions in square
    brackets, the range of the per-repetition ratios in round ones); the A/A
    ratio (one system against itself: the noise floor), per link and workload; with digest
    arms, each arm against the first."""
    opts = result["options"]
    aa = result.get("aa")
    compared = result.get("systems", SYSTEMS)
    systems = [*compared, *([aa[1]] if aa else [])]
    table = Table(
        title=f"bench pd ({result['binding']['regime']} cores): median (min–max) over "
        f"{opts['reps']} reps, ms unless noted; ratio = {compared[0]} / {compared[1]} "
        "[90% interval] (per-rep min–max)"
        + (f"; A/A = {aa[0]} / {aa[1]} (noise floor)" if aa else "")
    )
    cols = ["link", "workload", "metric", *systems, "ratio", *(["A/A"] if aa else []), "n"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("link", "workload", "metric") else "right")
    for row in result["summary"]:
        cells = [_cell(row["spread"][s], row["metric"]) for s in systems]
        ratio = _ratio_cell(row)
        noise = [_ratio_cell(row["aa"])] if aa else []
        n = "/".join(str(row["spread"][s]["n"]) for s in systems)
        table.add_row(row["link"], row["workload"], row["metric"], *cells, ratio, *noise, n)
    console.print(table)
    console.print(result["binding"]["text"])
    for system, scope in result.get("cpu_scope", {}).items():
        console.print(f"CPU of {system}'s transfer path: {scope}")
    for link in result["links"]:
        if link["link"] == "shaped":
            console.print(
                f"shaped link: {link['rate_bps'] / 1e6:.1f} Mbit/s, burst {link['burst']} B, "
                f"latency {link['latency_ms']} ms"
            )
    for row in result.get("digest") or ():
        console.print(digest_line(row))
    for t in result["not_counted"]:
        console.print(f"[red]not counted[/red]: {t}")


def digest_line(row: dict[str, Any]) -> str:
    """One arm's figure against the base arm, with its interval."""
    iv = row["interval"]
    op = "-" if row["how"] == "difference" else "/"
    head = f"{row['link']} {row['workload']} {row['metric']}: {row['system']} {op} {row['base']}"
    if iv is None:
        return f"{head}: no paired repetition"
    fmt = ".1f" if row["how"] == "difference" else ".3f"
    span = (
        f" [{iv['low']:{fmt}}, {iv['high']:{fmt}}] ({iv['level']:.0%}, {iv['units']} reps)"
        if iv["low"] is not None
        else f" (no interval: {iv['units']} rep)"
    )
    return f"{head} = {iv['point']:{fmt}}{span}"


def plot(result: dict[str, Any], path: Path) -> Path:
    """TTFT and exposed transfer per workload, per system and link, medians with min–max bars
    (needs the ``bench`` extra)."""
    import matplotlib

    matplotlib.use("Agg")  # no display here, and none wanted
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    rows = result["summary"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    for ax, metric, title in (
        (axes[0], "ttft_ms", "TTFT at the front door (ms)"),
        (axes[1], "exposed_ms", "exposed transfer: P done -> KV landed at D (ms)"),
    ):
        for link, style in (("unshaped", "-"), ("shaped", "--")):
            for i, system in enumerate(result.get("systems", SYSTEMS)):
                color = f"C{3 * i % 10}"
                pts = {
                    r["workload"]: r["spread"][system]
                    for r in rows
                    if r["link"] == link and r["metric"] == metric
                }
                if not pts:
                    continue
                nan = float("nan")
                sp = [pts.get(w) or {"median": None, "min": None, "max": None} for w in workloads]
                mid = [nan if p["median"] is None else p["median"] for p in sp]
                # Bars from the fastest to the slowest counted trial.
                low = [
                    0.0 if p["min"] is None else m - p["min"] for p, m in zip(sp, mid, strict=True)
                ]
                high = [
                    0.0 if p["max"] is None else p["max"] - m for p, m in zip(sp, mid, strict=True)
                ]
                ax.errorbar(
                    workloads,
                    mid,
                    yerr=[low, high],
                    fmt="o" + style,
                    color=color,
                    capsize=3,
                    label=f"{system} ({link})",
                )
        ax.set_title(title)
        ax.set_xlabel("workload (prompt tokens; NxT = N prompts at once)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    regime = result.get("binding", {}).get("regime", "shared")
    fig.suptitle(f"bench pd, {regime} cores: medians, bars from min to max")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
