"""``bench turns``' summary from hand-made rows: P50 per turn index, the ratios at turns 3 and
later, the turns where prefill computed more than the new message and a block, and which
answers all three systems gave alike."""

from __future__ import annotations

from typing import Any

from app.bench.turns_bench import NO_ANSWERS, answers_equal, summarize
from app.bench.turns_workload import TurnsWorkload

W = TurnsWorkload(conversations=2, turns=3)


def row(
    system: str, conv: int, turn: int, ttft: float, computed: float, **kw: Any
) -> dict[str, Any]:
    return {
        "system": system,
        "conversation": conv,
        "turn": turn,
        "long": True,
        "prompt_tokens": 1000,
        "new_tokens": 100,
        "history_tokens": 900,
        "ttft_ms": ttft,
        "prefill_computed": computed,
        "prefill_cached": 0.0,
        "prefill_loaded": 0.0,
        "pool_bytes": None,
        "kv_bytes": 0,
        "answer": kw.get("answer", [1, 2]),
    }


def rows_of(
    system: str, ttfts: tuple[float, float, float], computed: float, **kw: Any
) -> list[dict[str, Any]]:
    return [row(system, c, t + 1, ttfts[t] + c, computed, **kw) for t in range(3) for c in range(2)]


def test_ratios_use_turns_3_on_and_count_turns_that_computed_too_much() -> None:
    rows = rows_of("kv-sidecar", (500, 300, 100), 150) + rows_of(NO_ANSWERS, (500, 400, 400), 900)
    rows += rows_of("mooncake", (600, 500, 500), 900) + rows_of(
        "kv-sidecar-aa", (500, 300, 110), 150
    )
    s = summarize(rows, W)
    assert s["per_turn"]["kv-sidecar"]["3"]["ttft_p50_ms"] == 100.5  # median of 100 and 101
    ratios = s["ttft_p50_ratio_turns_3_on"]
    assert ratios["kv-sidecar/kv-sidecar-no-answers"]["median"] == 100.5 / 400.5
    assert ratios["kv-sidecar/mooncake"]["n"] == 1  # turn 3 only
    assert ratios["kv-sidecar-aa/kv-sidecar (A/A)"]["median"] == 110.5 / 100.5
    # 150 <= 100 + 128; 900 is not, on both turn-3 requests of each of those systems.
    over = s["computed_over_new_plus_block"]
    assert over == {"kv-sidecar": 0, NO_ANSWERS: 2, "mooncake": 2, "kv-sidecar-aa": 0}


def test_answers_alike_only_where_every_system_answered_the_same() -> None:
    rows = rows_of("kv-sidecar", (1, 1, 1), 0) + rows_of(NO_ANSWERS, (1, 1, 1), 0)
    rows += rows_of("mooncake", (1, 1, 1), 0)
    rows[-1]["answer"] = [9, 9]  # mooncake's last turn answered otherwise
    assert answers_equal(rows, ("kv-sidecar", NO_ANSWERS, "mooncake")) == {
        "equal": 5,
        "compared": 6,
    }
