"""``bench turns``' stage split of a turn, from hand-made sidecar records (through
``sidecar_timeline``, as the bench reads them): the four stages add
up to the TTFT, the pool's load is this turn's only, prefill's forward counts only the steps
that computed prompt tokens, and a missing stamp leaves its stages unknown (None), not zero."""

from __future__ import annotations

from typing import Any

import pytest

from app.bench.core.observe import sidecar_timeline
from app.bench.core.stats import Iteration
from app.bench.turns.stages import STAGES, prefill_forward_ms, sidecar_stages

T = 1_800_000_000.0


def timeline(began: float | None, signalled: list[float], done: float) -> dict[str, Any]:
    """A turn's transfer timeline as ``bench turns`` gets it, from sidecar records."""
    send = {
        "side": "send",
        "state": "DONE",
        "layers": [{"layer": i, "signalled_at": s} for i, s in enumerate(signalled)],
        "steps": [{"began_at": began, "forward_ended_at": T + 0.9}],
    }
    recvs = [
        {"side": "recv", "state": "DONE", "ended_at": done},
        {"side": "recv", "state": "FAILED", "ended_at": done + 5},  # not a landing
    ]
    return sidecar_timeline([send], recvs)


def test_the_stages_add_up_to_the_ttft_and_take_this_turns_load_only() -> None:
    calls = [
        {"kind": "load", "started_at": T - 3.0, "ended_at": T - 2.9},  # an earlier turn's
        {"kind": "save", "started_at": T + 0.01, "ended_at": T + 0.05},
        {"kind": "load", "started_at": T + 0.02, "ended_at": T + 0.045},
    ]
    out = sidecar_stages(
        T, T + 0.8, timeline(T + 0.06, [T + 0.3, T + 0.7, T + 0.5], T + 0.71), calls
    )
    assert out["to_forward"] == pytest.approx(60, abs=1e-3)
    assert out["forward"] == pytest.approx(
        640, abs=1e-3
    )  # to the last layer signalled, not the first
    assert out["handoff"] == pytest.approx(10, abs=1e-3)
    assert out["first_token"] == pytest.approx(90, abs=1e-3)
    assert sum(out[k] or 0 for k in STAGES) == pytest.approx(800, abs=1e-3)
    assert out["pool_load"] == pytest.approx(25, abs=1e-3)


def test_a_missing_stamp_leaves_its_stages_unknown() -> None:
    out = sidecar_stages(T, T + 0.8, timeline(None, [T + 0.3], T + 0.4), [])
    assert out["to_forward"] is None and out["forward"] is None
    assert out["handoff"] == pytest.approx(100, abs=1e-3)
    assert out["pool_load"] is None  # no load: unknown, not a zero-length load


def test_prefill_forward_counts_the_steps_that_computed_the_prompt() -> None:
    steps = [
        Iteration(T, 1, 300, 0, 0, 400.0),
        Iteration(T + 1, 1, 45, 0, 0, 60.0),  # a second chunk of the same prompt
        Iteration(T + 2, 0, 0, 1, 1, 30.0),  # a decode step: not prefill's compute
        Iteration(T + 3, 1, 10, 0, 0),  # no elapsed time logged
    ]
    assert prefill_forward_ms(steps) == pytest.approx(460, abs=1e-3)
    assert prefill_forward_ms(steps[2:]) is None
