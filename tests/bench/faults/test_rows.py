"""``bench faults``: one phase's row from its answers (``faults.plan.fault_row``, ``outcome``)."""

from __future__ import annotations

from typing import Any

from app.bench.core.slo import Slo
from app.bench.faults.plan import fault_row, outcome

# TTFT limit at 100 tokens: 2 x (10 + 10) ms + 100 ms = 140 ms; TPOT limit 30 ms.
SLO = Slo(prefill_a_s=0.010, prefill_b_s=0.0001, tpot_s=0.020)
REF = [5, 6, 7, 8]


def _answer(index: int, sent: float, **kw: Any) -> dict[str, Any]:
    a = {"index": index, "sent": sent, "first": sent + 0.05, "last": sent + 0.11}
    a |= {"ended": sent + 0.11, "tokens": list(REF), "prompt_tokens": 100, "max_tokens": 4}
    return a | {"error": None} | kw


def test_outcomes() -> None:
    assert outcome(_answer(0, 0), REF, SLO) == "good"
    assert outcome(_answer(0, 0, first=0.5, last=0.56), REF, SLO) == "slow"
    assert outcome(_answer(0, 0, tokens=[5, 6, 9, 8]), REF, SLO) == "wrong"
    assert outcome(_answer(0, 0, tokens=[5, 6]), REF, SLO) == "error"  # a cut stream
    assert outcome(_answer(0, 0, error="HTTPStatusError: 503"), REF, SLO) == "error"
    assert outcome(_answer(0, 0, error="cancelled: past the drain"), REF, SLO) == "lost"


def test_a_row_counts_each_outcome_once_and_splits_at_the_kill() -> None:
    answers = [_answer(i, float(i)) for i in range(4)]  # good before the kill at 4
    answers += [
        _answer(4, 4.0, error="HTTPStatusError: 502"),
        _answer(5, 5.0, error="ReadError: reset"),
        _answer(6, 6.0, tokens=[1, 2, 3, 4]),
        _answer(7, 7.0, error="cancelled: past the drain"),
        _answer(8, 8.0, first=8.5, last=8.56),
    ]
    answers += [_answer(i, float(i)) for i in range(9, 20)]
    refs = {a["index"]: REF for a in answers}
    row = fault_row(
        "prefill-vllm",
        answers,
        refs,
        SLO,
        kill_at=4.0,
        window=3,
        target=0.9,
        hold_s=2,
        lost_records=2,
        changed=(0, 0),
        alone_blocks=3,
        restart_s=12.5,
        notes=["n"],
    )
    assert (row.sent, row.errors, row.wrong, row.lost) == (20, 2, 1, 3)
    assert row.back_s == 5.0  # the first request from which windows of 3 all met it
    assert row.attainment_before == 1.0
    assert row.attainment_after == 11 / 16
    assert (row.changed_bytes, row.changed_blocks, row.alone_blocks) == (0, 0, 3)
    assert row.restart_s == 12.5 and row.notes == ("n",)


def test_the_control_row_has_no_kill_and_no_return() -> None:
    answers = [_answer(i, float(i)) for i in range(5)]
    refs = {i: REF for i in range(5)}
    row = fault_row("none", answers, refs, SLO, None, window=3, target=0.9, hold_s=2)
    assert row.back_s is None and row.attainment_after is None
    assert row.attainment_before == 1.0 and row.changed_bytes is None
