"""A ``bench pd`` trial's figures from what was observed, for both systems alike (no engines)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from app.bench.core.stats import Iteration
from app.bench.core.trial import figures, line

T = 1_764_237_600.0
REFS = [{"n-1": [5, 6, 7], "n": [5, 6, 8]}]
P = {"arrival_to_step_s": 0.004, "prefill_s": 0.300}


def ms(x: float) -> Any:
    return pytest.approx(x, abs=1e-3)  # differences of Unix times: a float's precision


def _answer(tokens: list[int]) -> dict[str, Any]:
    return {"sent": T, "first": T + 0.5, "tokens": tokens}


TAPS = [{"arrived": T + 0.01, "ended": T + 0.40}]  # P's answer back at the tap


def _sidecar_moved(kv_landed: float | None = T + 0.35) -> dict[str, Any]:
    return {
        "bytes": 2**29,
        "landed": [T + 0.37],
        "timeline": {
            "kv_landed": kv_landed,
            "d_done": T + 0.37,
            "forward_end": T + 0.33,
            "layer_write_s": 0.004,
        },
        "p_finished": [],
        "records": [],
    }


def _mooncake_moved() -> dict[str, Any]:
    return {
        "bytes": 2**29,
        "landed": [T + 0.45],
        "timeline": None,
        "p_finished": [T + 0.39],
        "records": [],
    }


def _steps(context_tokens: int) -> list[Iteration]:
    return [
        Iteration(T + 0.40, 0, 0, 0, 0, 0.5),  # a step that computed nothing
        Iteration(T + 0.46, 1, context_tokens, 0, 0, 140.0),
        Iteration(T + 0.47, 0, 0, 1, 1, 25.0),
    ]


def test_sidecar_exposed_from_its_timeline() -> None:
    f = figures(T, [_answer([5, 6, 7])], TAPS, P, _sidecar_moved(), _steps(1), REFS, 512, 0.25)
    assert f["counted"] and f["references_matched"] == ["n-1"]
    assert f["ttft_ms"] == ms(500)
    assert f["p_start_ms"] == ms(14)
    assert f["exposed_ms"] == ms(-50)  # landed before P's answer was back
    assert f["exposed_d_done_ms"] == ms(-30)
    assert f["exposed_after_forward_ms"] == ms(20)
    assert f["layer_write_ms"] == ms(4)
    assert f["exposed_derived_ms"] == ms(100)
    assert f["transfer_cpu_ms"] == ms(250)
    assert f["cpu_ms_per_request"] == ms(250)
    assert f["cpu_s_per_gib"] == ms(0.5)
    assert f["d_first_step_ms"] == 140.0  # decode's step over the prompt's last token
    assert math.isnan(f["exposed_hook_ms"])
    assert "ok" in line(f | {"link": "unshaped", "rep": 0, "workload": "512", "system": "x"})


def test_mooncake_exposed_from_its_receiver_and_the_same_gates() -> None:
    f = figures(T, [_answer([5, 6, 8])], TAPS, P, _mooncake_moved(), _steps(1), REFS, 512, 0.1)
    assert f["counted"] and f["references_matched"] == ["n"]  # its own rounding: counted
    assert f["exposed_ms"] == ms(50)
    assert f["exposed_d_done_ms"] == ms(50)
    assert math.isnan(f["exposed_after_forward_ms"]) and math.isnan(f["layer_write_ms"])
    assert f["exposed_hook_ms"] == ms(60)


@pytest.mark.parametrize("moved", [_sidecar_moved(), _mooncake_moved()])
def test_a_recomputed_prompt_is_a_failed_load_for_either_system(moved: dict[str, Any]) -> None:
    # The receiver stamped a landing, the output is right, but decode computed the prompt.
    f = figures(T, [_answer([5, 6, 7])], TAPS, P, moved, _steps(512), REFS, 512, 0.1)
    assert f["failed_loads"] == 1 and f["d_computed_tokens"] == 512
    assert not f["counted"]
    text = line(f | {"link": "unshaped", "rep": 0, "workload": "512", "system": "x"})
    assert "NOT COUNTED" in text and "failed loads 1" in text


def test_wrong_output_or_missing_landing_is_not_counted() -> None:
    wrong = figures(T, [_answer([9, 9, 9])], TAPS, P, _sidecar_moved(), _steps(1), REFS, 512, 0)
    assert wrong["references_matched"] == [None] and not wrong["counted"]
    moved = _sidecar_moved(kv_landed=None) | {"landed": []}
    lost = figures(T, [_answer([5, 6, 7])], TAPS, P, moved, _steps(1), REFS, 512, 0)
    assert not lost["counted"] and math.isnan(lost["exposed_ms"])
    # No bytes: no per-GiB cost.
    assert math.isnan(
        figures(T, [_answer([5, 6, 7])], TAPS, P, moved | {"bytes": 0}, [], REFS, 512, 0)[
            "cpu_s_per_gib"
        ]
    )
