"""``bench turns``'s table and figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from app.bench.turns.stages import STAGES


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
    for title, key in (
        ("TTFT P50 at turns >= 3", "ttft_p50_turns_3_on"),
        ("TTFT P50 at turn 1 (parity: the same work on every system)", "turn_1_parity"),
        ("prefill's forward P50 at turns >= 3", "p_forward_p50_turns_3_on"),
    ):
        for pair, iv in s.get(key, {}).items():
            console.print(f"{title}, {pair}: {interval(iv)}")
    for name, iv in s.get("aa_round_2_over_1", {}).items():
        console.print(f"A/A, {name} round 2 / round 1, TTFT P50 at turns >= 3: {interval(iv)}")
    console.print(
        "turns >= 3 where prefill computed more than the new message (and the chat template's "
        "markers) and one block: "
        + ", ".join(f"{k} {v}" for k, v in s["computed_over_new_plus_block"].items())
    )
    for pair, by_turn in s.get("computed_at_most", {}).items():
        console.print(
            f"prefill computed {pair}'s (mean per turn): "
            + ", ".join(f"turn {t} {'yes' if ok else 'no'}" for t, ok in by_turn.items())
        )
    _print_drift(s.get("drift", {}), console)
    _print_stages(s["per_turn"], w["turns"], console)
    for name, k in s.get("prefix_kept", {}).items():
        if k["checked"]:
            console.print(
                f"chat: {name}'s prompt kept the previous prompt and answer's ids as generated: "
                f"{k['kept']} of {k['checked']} turns"
            )
    eq = s["answers_equal"]
    console.print(
        f"answers alike on every system and round: {eq['equal']} of {eq['compared']} turns"
    )


def interval(iv: dict[str, Any] | None) -> str:
    """A ratio and its bootstrap interval as the docs write it: 0.42 [0.38-0.47] (90%, 12
    conversations)."""
    if iv is None:
        return "-"
    if iv["low"] is None:
        return f"{iv['point']:.2f} (no interval: {iv['units']} conversation)"
    return (
        f"{iv['point']:.2f} [{iv['low']:.2f}-{iv['high']:.2f}] "
        f"({iv['level']:.0%}, {iv['units']} conversations)"
    )


def _print_drift(drift: dict[str, Any], console: Console) -> None:
    """Each system's rounds in run order: what moved between them, on the same work."""
    table = Table(title="between rounds (the same work, a fresh system each block): TTFT P50 ms")
    for col in ("system", "round", "turn 1", "turns >= 3", "turns >= 3 / round 1"):
        table.add_column(col, justify="left" if col == "system" else "right")
    for name, d in drift.items():
        for r in d["rounds"]:
            table.add_row(
                name,
                str(r["round"] + 1),
                _f(r["turn_1_p50_ms"]),
                _f(r["turns_3_on_p50_ms"]),
                interval(r["over_first"]) if r["over_first"] else "-",
            )
    console.print(table)


def _print_stages(per: dict[str, Any], turns: int, console: Console) -> None:
    """Where the TTFT goes (P50 ms): prefill's forward and the rest, every system; kv-sidecar's
    stages from its sidecars' stamps (``turns.stages``). Older results lack them: "-"."""
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
