"""``bench routing``'s table and figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from app.bench.routing.bench import POLICIES

_METRICS = (
    ("prefill_tokens_computed", "prefill tokens computed", "{:.0f}"),
    ("hit_rate", "prefix-cache hit rate", "{:.2f}"),
    ("ttft_p50_ms", "TTFT P50 (ms)", "{:.0f}"),
    ("ttft_p90_ms", "TTFT P90 (ms)", "{:.0f}"),
    ("index_blocks", "index blocks at the end", "{:.0f}"),
    ("tail_in_burst", "slowest tenth: of the burst", "{:.0f}"),
    ("tail_decode_target_ms", "slowest tenth: decode's target (ms)", "{:.0f}"),
    ("tail_prefill_ms", "slowest tenth: prefill call (ms)", "{:.0f}"),
)


def _cell(sp: dict[str, Any], fmt: str) -> str:
    if sp["median"] is None:
        return "-"
    return f"{fmt.format(sp['median'])} [{fmt.format(sp['min'])}-{fmt.format(sp['max'])}]"


def print_summary(result: dict[str, Any], console: Console) -> None:
    """Medians over the reps, [min-max], per policy; then precise / approximate."""
    per = result["summary"]["policies"]
    w = result["workload"]
    table = Table(
        title=f"bench routing: {w['requests']} requests of {w['tenants']} tenants, "
        f"{result['engines']['prefills']} prefills of {result['engines']['cache_blocks']} blocks"
    )
    table.add_column("metric")
    for p in POLICIES:
        table.add_column(p, justify="right")
    for key, name, fmt in _METRICS:
        table.add_row(name, *(_cell(per[p][key], fmt) for p in POLICIES))
    console.print(table)
    for key, sp in result["summary"]["precise_over_approximate"].items():
        console.print(f"precise / approximate, {key}: {_cell(sp, '{:.2f}')} (per rep)")


def plot(result: dict[str, Any], path: Path) -> Path:
    """Prefill tokens computed and TTFT per policy, medians with min-max bars (needs the
    ``bench`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per = result["summary"]["policies"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    x = range(len(POLICIES))
    for ax, keys, title in (
        (axes[0], ("prefill_tokens_computed",), "prefill tokens computed (vLLM's counter)"),
        (axes[1], ("ttft_p50_ms", "ttft_p90_ms"), "TTFT (ms)"),
    ):
        width = 0.8 / len(keys)
        for j, key in enumerate(keys):
            sps = [per[p][key] for p in POLICIES]
            mid = [s["median"] or 0.0 for s in sps]
            low = [m - (s["min"] or m) for s, m in zip(sps, mid, strict=True)]
            high = [(s["max"] or m) - m for s, m in zip(sps, mid, strict=True)]
            ax.bar(
                [i + j * width for i in x],
                mid,
                width,
                yerr=[low, high],
                capsize=3,
                label=key.replace("ttft_", "").replace("_ms", ""),
            )
        ax.set_xticks([i + width * (len(keys) - 1) / 2 for i in x], POLICIES)
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
        if len(keys) > 1:
            ax.legend()
    fig.suptitle("bench routing: medians over reps, bars from min to max")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
