"""``bench load``'s handoff per request: P's answer back at the tap → the client's first token,
paired by the prompt each carried, not by arrival order."""

from __future__ import annotations

from typing import Any

import pytest

from app.bench.core.front import prompt_key
from app.bench.core.slo import Slo
from app.bench.core.step import p_answered, prompt_of
from app.bench.load.stats import step_figures

SLO = Slo(prefill_a_s=0.010, prefill_b_s=0.0001, tpot_s=0.020)
RUNG = 3


def _key(index: int, tokens: int) -> str | None:
    # The token ids the client sent for (rung, index), as JSON carried them to the tap.
    return prompt_key(list(prompt_of(tokens, RUNG, index)))


def _answer(index: int, tokens: int, first: float | None) -> dict[str, Any]:
    return {
        "index": index,
        "prompt_tokens": tokens,
        "prompt_key": _key(index, tokens),
        "max_tokens": 4,
        "sent": 0.0,
        "first": first,
        "last": None if first is None else first + 0.06,
        "tokens": [1, 2, 3, 4] if first is not None else [],
        "error": None,
        "ended": 1.0,
    }


def _tap(index: int, tokens: int, ended: float, status: int = 200) -> dict[str, Any]:
    key = _key(index, tokens)
    return {"arrived": ended - 0.5, "ended": ended, "status": status, "prompt_key": key}


def test_each_answer_gets_its_own_prompts_p_answer() -> None:
    answers = [_answer(0, 64, 0.90), _answer(1, 64, 0.50), _answer(2, 128, None)]
    # Taps listed out of order; request 1's P answered twice (a retry): the last 200 counts;
    # request 2's P failed.
    taps = [_tap(1, 64, 0.40), _tap(0, 64, 1.00), _tap(1, 64, 0.45), _tap(2, 128, 0.7, 500)]
    paired = p_answered(answers, taps)
    assert [a["p_answered"] for a in paired] == [1.00, 0.45, None]
    f = step_figures(paired, SLO)
    assert f["after_p_n"] == 2
    # -100 ms (decode's first token before P's answer was back) and +50 ms.
    assert f["after_p_p50_ms"] == pytest.approx(-25.0)
    # Two requests: no P99 (core.slo.tail), their max.
    assert f["after_p_p99_ms"] is None and f["after_p_max_ms"] == pytest.approx(50.0)


def test_another_requests_prompt_is_not_paired() -> None:
    # The same length, another request of the step: another prompt.
    other = _key(1, 64)
    taps = [{"arrived": 0.0, "ended": 1.0, "status": 200, "prompt_key": other}]
    (a,) = p_answered([_answer(0, 64, 0.9)], taps)
    assert a["p_answered"] is None
    assert step_figures([a], SLO)["after_p_p50_ms"] is None


def test_only_token_id_prompts_have_a_key() -> None:
    assert prompt_key([1, 2, 3]) == prompt_key([1, 2, 3]) != prompt_key([1, 2, 4])
    assert prompt_key([1, 2, 3]) != prompt_key([1, 2, 3, 0])
    assert prompt_key("a text prompt") is None and prompt_key(None) is None
