"""``bench turns``'s table and figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from app.bench.turn_stages import STAGES


def _f(v: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def print_summary(result: dict[str, Any], console: Console) -> None:
    """Per turn index and system: TTFT P50/P90, new tokens, prefill computed/cached/loaded."""
    s = result["summary"]
    w = result["workload"]
    table = Table(
        title=f"bench turns: {w['conversations']} conversations x {w['turns']} turns, "
        f"{w['answer_tokens']} tokens per answer"
    )
    for col in (
        "turn",
        "system",
        "TTFT P50/P90 ms",
        "new",
        "history",
        "prefill computed",
        "cached",
        "loaded",
        "pool MiB",
        "P->D MiB",
    ):
        table.add_column(col, justify="left" if col == "system" else "right")
    mib = 1 / (1 << 20)
    for t in range(1, w["turns"] + 1):
        for name, per in s["per_turn"].items():
            r = per[str(t)]
            table.add_row(
                str(t),
                name,
                f"{_f(r['ttft_p50_ms'])}/{_f(r['ttft_p90_ms'])}",
                _f(r["new_tokens"]),
                _f(r["history_tokens"]),
                _f(r["prefill_computed"]),
                _f(r["prefill_cached"]),
                _f(r["prefill_loaded"]),
                _f(None if r["pool_bytes"] is None else r["pool_bytes"] * mib, "{:.1f}"),
                _f(r["kv_bytes"] * mib if r["kv_bytes"] is not None else None, "{:.1f}"),
            )
    console.print(table)
    for key, sp in s["ttft_p50_ratio_turns_3_on"].items():
        console.print(
            f"TTFT P50 at turns >= 3, {key}: median {_f(sp['median'], '{:.2f}')} "
            f"[{_f(sp['min'], '{:.2f}')}-{_f(sp['max'], '{:.2f}')}] over {sp['n']} turn indexes"
        )
    console.print(
        "turns >= 3 where prefill computed more than the new message and one block: "
        + ", ".join(f"{k} {v}" for k, v in s["computed_over_new_plus_block"].items())
    )
    for key, sp in s.get("p_forward_p50_ratio_turns_3_on", {}).items():
        console.print(
            f"prefill's forward P50 at turns >= 3, {key}: median {_f(sp['median'], '{:.2f}')} "
            f"[{_f(sp['min'], '{:.2f}')}-{_f(sp['max'], '{:.2f}')}]"
        )
    _print_stages(s["per_turn"], w["turns"], console)
    eq = s["answers_equal"]
    console.print(f"answers alike on all three systems: {eq['equal']} of {eq['compared']} turns")


def _print_stages(per: dict[str, Any], turns: int, console: Console) -> None:
    """Where the TTFT goes (P50 ms): prefill's forward and the rest, every system; kv-sidecar's
    stages from its sidecars' stamps (``turn_stages``). Older results lack them: "-"."""
    table = Table(title="where the TTFT goes, P50 ms (kv-sidecar's stages from its sidecars)")
    cols = ("turn", "system", "TTFT", "P fwd", "TTFT-P fwd", *STAGES, "pool load")
    for col in cols:
        table.add_column(col, justify="left" if col == "system" else "right")
    for t in range(1, turns + 1):
        for name, rows in per.items():
            r = rows[str(t)]
            st = r.get("stages_p50_ms") or {}
            table.add_row(
                str(t),
                name,
                _f(r["ttft_p50_ms"]),
                _f(r.get("p_forward_p50_ms")),
                _f(r.get("ttft_minus_forward_p50_ms")),
                *(_f(st.get(k)) for k in (*STAGES, "pool_load")),
            )
    console.print(table)


def plot(result: dict[str, Any], path: Path) -> Path:
    """TTFT P50 (P90 dashed) and prefill's computed tokens against the turn index, per system
    (needs the ``bench`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per = result["summary"]["per_turn"]
    turns = list(range(1, result["workload"]["turns"] + 1))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in per.items():
        (line,) = axes[0].plot(
            turns, [rows[str(t)]["ttft_p50_ms"] for t in turns], "o-", label=f"{name} P50"
        )
        axes[0].plot(
            turns,
            [rows[str(t)]["ttft_p90_ms"] for t in turns],
            "--",
            color=line.get_color(),
            alpha=0.6,
        )
        axes[1].plot(turns, [rows[str(t)]["prefill_computed"] for t in turns], "o-", label=name)
    new = [next(iter(per.values()))[str(t)]["new_tokens"] for t in turns]
    axes[1].plot(turns, new, "k:", label="new message (tokens)")
    axes[0].set_title("TTFT (ms): P50, P90 dashed")
    axes[1].set_title("prefill tokens computed (vLLM's counter), mean")
    for ax in axes:
        ax.set_xlabel("turn")
        ax.set_xticks(turns)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("bench turns")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
