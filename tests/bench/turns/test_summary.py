"""``bench turns``' summary from hand-made rows of interleaved rounds: P50 per turn index pooled
over rounds, kv-sidecar's ratios at turns 3 and later and at turn 1 with their intervals, the
A/A and drift from two rounds of one system, the turns where prefill computed more than the new
message and a block, and which answers every system gave alike."""

from __future__ import annotations

from typing import Any

import pytest

from app.bench.core.store_pd import STORE_PEER
from app.bench.turns.summary import NO_ANSWERS, answers_equal, summarize
from app.bench.turns.workload import TurnsWorkload

W = TurnsWorkload(conversations=4, turns=3)
SC = "kv-sidecar"


def row(
    system: str, conv: int, turn: int, ttft: float, computed: float, rnd: int = 0, **kw: Any
) -> dict[str, Any]:
    return {
        "system": system,
        "round": rnd,
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
    system: str, ttfts: tuple[float, float, float], computed: float, rnd: int = 0, **kw: Any
) -> list[dict[str, Any]]:
    return [
        row(system, c, t + 1, ttfts[t] + c, computed, rnd, **kw)
        for t in range(3)
        for c in range(W.conversations)
    ]


def two_rounds(
    system: str, ttfts: tuple[float, float, float], computed: float, slower: float = 1.0
) -> list[dict[str, Any]]:
    later = tuple(x * slower for x in ttfts)
    return rows_of(system, ttfts, computed, 0) + rows_of(system, later, computed, 1)  # type: ignore[arg-type]


def test_ratios_pool_turns_3_on_over_rounds_with_an_interval() -> None:
    rows = two_rounds(SC, (500, 300, 100), 150) + two_rounds(STORE_PEER, (500, 400, 400), 900)
    s = summarize(rows, W)
    # Turn 3, conversations 0-3, two rounds alike: the median of 100..103 twice.
    assert s["per_turn"][SC]["3"]["ttft_p50_ms"] == 101.5
    assert s["per_turn"][SC]["3"]["requests"] == 8
    iv = s["ttft_p50_turns_3_on"][f"{SC}/{STORE_PEER}"]
    assert iv["point"] == pytest.approx(101.5 / 401.5)
    assert iv["low"] <= iv["point"] <= iv["high"] < 0.26
    assert (iv["units"], iv["level"]) == (4, 0.9)
    parity = s["turn_1_parity"][f"{SC}/{STORE_PEER}"]
    assert parity["point"] == 1.0


def test_the_aa_is_a_systems_second_round_over_its_first_and_drift_is_per_round() -> None:
    rows = two_rounds(SC, (500, 300, 100), 150, slower=1.2) + two_rounds(
        STORE_PEER, (500, 400, 400), 900
    )
    s = summarize(rows, W)
    assert s["aa_round_2_over_1"][SC]["point"] == pytest.approx(1.2, rel=0.01)
    assert s["aa_round_2_over_1"][STORE_PEER]["point"] == 1.0
    rounds = s["drift"][SC]["rounds"]
    assert [r["round"] for r in rounds] == [0, 1]
    assert rounds[0]["turn_1_p50_ms"] == 501.5
    assert rounds[1]["turn_1_p50_ms"] == pytest.approx(1.2 * 500 + 1.5)
    assert rounds[0]["over_first"] is None


def test_ablations_join_the_ratios_and_computed_turns_are_counted() -> None:
    rows = two_rounds(SC, (500, 300, 100), 150) + two_rounds(NO_ANSWERS, (500, 400, 400), 900)
    rows += two_rounds("mooncake", (600, 500, 500), 900)
    s = summarize(rows, W)
    assert set(s["ttft_p50_turns_3_on"]) == {f"{SC}/{NO_ANSWERS}", f"{SC}/mooncake"}
    # 150 <= 100 + 128; 900 is not, on each turn-3 request of those systems, both rounds.
    assert s["computed_over_new_plus_block"] == {SC: 0, NO_ANSWERS: 8, "mooncake": 8}
    assert s["computed_at_most"][f"{SC}<={NO_ANSWERS}"] == {"1": True, "2": True, "3": True}
    worse = summarize(two_rounds(SC, (1, 1, 1), 950) + two_rounds(NO_ANSWERS, (1, 1, 1), 900), W)
    assert worse["computed_at_most"][f"{SC}<={NO_ANSWERS}"]["3"] is False


def test_answers_alike_only_where_every_system_answered_the_same_in_every_round() -> None:
    rows = two_rounds(SC, (1, 1, 1), 0) + two_rounds(STORE_PEER, (1, 1, 1), 0)
    assert answers_equal(rows, (SC, STORE_PEER)) == {"equal": 12, "compared": 12}
    rows[-1]["answer"] = [9, 9]  # the peer's second round answered its last turn otherwise
    assert answers_equal(rows, (SC, STORE_PEER)) == {"equal": 11, "compared": 12}
