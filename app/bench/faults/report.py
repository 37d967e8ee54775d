"""``bench faults``'s table and plot."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

OUTCOMES = {  # outcome -> (plot color, y offset within the phase's lane)
    "good": ("C2", 0.0),
    "slow": ("C1", 0.1),
    "wrong": ("C4", 0.2),
    "error": ("C3", -0.1),
    "lost": ("k", -0.2),
}


HEADER = (  # a phase's row, here and in docs/benchmarks.md (faults.tables)
    "fault",
    "sent",
    "errors",
    "wrong",
    "lost",
    "changed B (blocks / bound)",
    "goodput back s",
    "restart s",
    "SLO met before / after",
)


def _s(v: float | None, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def back_cell(r: Mapping[str, Any]) -> str:
    """When goodput came back after the kill, s; '-' for the control phase."""
    if r["fault"] == "none":
        return "-"
    return "not back" if r["back_s"] is None else f"{r['back_s']:.1f}"


def changed_cell(r: Mapping[str, Any]) -> str:
    """Bytes changed outside the records' blocks (blocks; the bound prompts no record names
    explain), or '-' where not measured."""
    if r["changed_bytes"] is None:
        return "-"
    return f"{r['changed_bytes']} ({r['changed_blocks']} / ≤{r['alone_blocks']})"


def print_summary(result: dict[str, Any], console: Console) -> None:
    """One row per phase, then each row's notes."""
    if "slo" in result:
        console.print(result["slo"]["text"])
        console.print(
            f"unloaded service time {1e3 * result['service_s']:.0f} ms; load "
            f"{result['rate']:.3g} req/s (Poisson, "
            f"{result['rate'] * result['service_s']:.2g} of the unloaded rate); "
            f"goodput back: windows of {result['options']['window']} requests "
            f"with ≥ {100 * result.get('target', 0.9):.0f}% meeting the SLO for "
            f"{result['options']['hold_s']:g} s"
        )
    table = Table(
        title="bench faults: one part killed (SIGKILL) under load, restarted; changed = bytes on "
        "decode outside every block a record named (blocks / blocks of unrecorded prompts)"
    )
    for head in HEADER:
        table.add_column(head, justify="left" if head == "fault" else "right")
    for p in result["phases"]:
        r = p["row"]
        table.add_row(
            r["fault"],
            str(r["sent"]),
            str(r["errors"]),
            str(r["wrong"]),
            str(r["lost"]),
            changed_cell(r),
            back_cell(r),
            _s(r["restart_s"]),
            f"{_s(r['attainment_before'], '.0%')} / {_s(r['attainment_after'], '.0%')}",
        )
    console.print(table)
    for p in result["phases"]:
        console.print(f"{p['row']['fault']}: " + "; ".join(p["row"]["notes"]))
    if result.get("error"):
        console.print(f"[red]stopped early: {result['error']}[/red]")


def plot(result: dict[str, Any], path: Path) -> Path:
    """Each request by send time from the kill (one lane per phase), colored by outcome; the
    restart's end and goodput's return marked (needs the ``bench`` extra)."""
    import matplotlib

    matplotlib.use("Agg")  # no display here, and none wanted
    import matplotlib.pyplot as plt

    phases = result["phases"]
    fig, ax = plt.subplots(figsize=(11, 1 + 0.8 * max(1, len(phases))))
    for lane, p in enumerate(phases):
        zero = p["kill_at"] if p["kill_at"] is not None else p["started"]
        for kind, (color, dy) in OUTCOMES.items():
            xs = [q["sent"] - zero for q in p["requests"] if q["outcome"] == kind]
            if xs:
                ax.plot(xs, [lane + dy] * len(xs), "|", color=color, label=kind, ms=9)
        if p["restart_done"] is not None:
            ax.plot([p["restart_done"] - zero], [lane], "v", color="k", ms=6)
        back = p["row"]["back_s"]
        if back is not None:
            ax.plot([back], [lane], "*", color="C0", ms=10)
    ax.axvline(0, color="C3", alpha=0.4)
    ax.set_yticks(range(len(phases)), [p["row"]["fault"] for p in phases])
    ax.invert_yaxis()  # the phases top down, in the order they ran
    ax.set_xlabel("send time, s from the kill (control: from its start); ▼ restarted, ★ back")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), fontsize=8, loc="upper right")
    ax.grid(alpha=0.3, axis="x")
    fig.suptitle(f"bench faults at {result.get('rate', 0):.3g} req/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
