"""``bench pd``'s table and plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from app.bench.pd_systems import MOONCAKE, SIDECAR


def _fmt(v: float | None, metric: str) -> str:
    if v is None:
        return "-"
    return f"{v / 2**20:.2f} MiB" if metric == "bytes" else f"{v:.1f}"


def print_summary(result: dict[str, Any], console: Console) -> None:
    """Medians per system and the ratio kv-sidecar / mooncake, per link and workload."""
    opts = result["options"]
    table = Table(
        title=f"bench pd: medians over {opts['reps']} reps (ms unless noted); ratio = "
        f"{SIDECAR} / {MOONCAKE}"
    )
    for col in ("link", "workload", "metric", SIDECAR, MOONCAKE, "ratio", "n"):
        table.add_column(col, justify="left" if col in ("link", "workload", "metric") else "right")
    for row in result["summary"]:
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
        n = f"{row[f'{SIDECAR}_n']}/{row[f'{MOONCAKE}_n']}"
        table.add_row(
            row["link"],
            row["workload"],
            row["metric"],
            _fmt(row[SIDECAR], row["metric"]),
            _fmt(row[MOONCAKE], row["metric"]),
            ratio,
            n,
        )
    console.print(table)
    for link in result["links"]:
        if link["link"] == "shaped":
            console.print(
                f"shaped link: {link['rate_bps'] / 1e6:.1f} Mbit/s, burst {link['burst']} B, "
                f"latency {link['latency_ms']} ms"
            )
    for t in result["not_counted"]:
        console.print(f"[red]not counted[/red]: {t}")


def plot(result: dict[str, Any], path: Path) -> Path:
    """TTFT and exposed transfer per workload, per system and link (needs the ``bench`` extra)."""
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
            for system, color in ((SIDECAR, "C0"), (MOONCAKE, "C3")):
                pts = {
                    r["workload"]: r[system]
                    for r in rows
                    if r["link"] == link and r["metric"] == metric
                }
                if not pts:
                    continue
                y = [pts.get(w) for w in workloads]
                ax.plot(
                    workloads,
                    [float("nan") if v is None else v for v in y],
                    "o" + style,
                    color=color,
                    label=f"{system} ({link})",
                )
        ax.set_title(title)
        ax.set_xlabel("workload (prompt tokens; NxT = N prompts at once)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
