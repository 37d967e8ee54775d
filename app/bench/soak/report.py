"""``bench soak``'s table and figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from app.bench.soak.stats import GROWTH_LIMIT, METRICS


def print_summary(result: dict[str, Any], console: Console) -> None:
    """Per watched process and metric: baseline, late level, highest, ratio; the verdict."""
    o = result["options"]
    table = Table(
        title=f"bench soak: {result['rate']} req/s for {o['duration_s']:g} s "
        f"(after {o['warmup_s']:g} s of warm-up; limit {GROWTH_LIMIT:g} x the baseline)"
    )
    for col in ("process/metric", "baseline", "late", "highest", "late / baseline"):
        table.add_column(col, justify="left" if col == "process/metric" else "right")
    for key, f in result["growth"].items():
        mark = " !" if key in result["grew"] else ""
        table.add_row(
            key,
            f"{f['base']:.1f}",
            f"{f['late']:.1f}",
            f"{f['max']:.1f}",
            f"{f['ratio']:.3f}{mark}",
        )
    console.print(table)
    w = result["windows"]
    if w:
        p90 = [x["ttft_p90_ms"] for x in w]
        console.print(
            f"TTFT P90 per minute: first {p90[0]:.0f} ms, last {p90[-1]:.0f} ms, "
            f"highest {max(p90):.0f} ms"
        )
    console.print(
        f"{result['requests']} requests: {result['errors']} errors ({result['ended_at_eos']} "
        f"ended at the model's EOS), {result['disaggregated']} disaggregated; sidecars' "
        "accounting: "
        + ("; ".join(result["ended_problems"]) or "every one ended once, DONE, on both sides")
    )
    console.print("soak holds" if result["holds"] else "soak does NOT hold")


def plot(result: dict[str, Any], path: Path) -> Path:
    """Each watched process's RSS, descriptors and threads over the soak (needs the ``bench``
    extra); the warm-up shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["usage"]
    fig, axes = plt.subplots(1, len(METRICS), figsize=(13, 3.8))
    for ax, metric in zip(axes, METRICS, strict=True):
        for proc in samples[0]["usage"]:
            ts = [s["t"] for s in samples if proc in s["usage"]]
            ax.plot(
                ts, [s["usage"][proc][metric] for s in samples if proc in s["usage"]], label=proc
            )
        ax.axvspan(0, result["options"]["warmup_s"], color="grey", alpha=0.15)
        ax.set_title(metric)
        ax.set_xlabel("s from the load's start")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"bench soak: {result['rate']} req/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
