"""``bench load``'s rounds (``load.compare``): figures pooled over a system's rounds, the ratios
and each system's A/A paired over request indices with bootstrap intervals, the knee ratio's
interval, the drift between rounds."""

from __future__ import annotations

from typing import Any

import pytest

from app.bench.core.slo import Slo
from app.bench.load.compare import compare, ttft_interval

A, B = "kv-sidecar", "mooncake"
SLO = Slo(prefill_a_s=0.1, prefill_b_s=0.0, tpot_s=0.02)  # TTFT <= 0.3 s, TPOT <= 30 ms


def _step(rate: float, system: str, rnd: int, ttfts: list[float]) -> dict[str, Any]:
    reqs = [
        {
            "index": i,
            "prompt_tokens": 100,
            "max_tokens": 4,
            "sent": float(i),
            "first": i + t,
            "last": i + t + 3 * 0.02,
            "ended": i + t + 0.1,
            "error": None,
            "tokens": 4,
        }
        for i, t in enumerate(ttfts)
    ]
    return {"rate": rate, "system": system, "round": rnd, "requests": reqs}


def _steps(rate: float, a: list[float], b: list[float], drift: float = 1.0) -> list[Any]:
    out = []
    for rnd in (0, 1):
        f = drift**rnd
        out += [_step(rate, A, rnd, [f * t for t in a]), _step(rate, B, rnd, [f * t for t in b])]
    for st in out:
        st |= {"span_s": 10.0, "p_prefill_ms": 50.0}
    return out


# Request i's TTFT differs 20x across requests; A takes half of B's on every one.
B_TTFT = [0.01 * (1 + 19 * i / 9) for i in range(10)]
A_TTFT = [t / 2 for t in B_TTFT]


def test_figures_pool_every_round_of_a_system() -> None:
    s = compare(_steps(1.0, A_TTFT, B_TTFT), (A, B), SLO)
    row = next(r for r in s["rows"] if r["system"] == A)
    assert row["n_requests"] == 20 and row["rounds"] == 2
    assert row["throughput_rps"] == pytest.approx(20 / 20.0)  # 20 answers over 2 x 10 s
    assert row["ttft_p99_ms"] is None and row["ttft_max_ms"] == pytest.approx(1e3 * A_TTFT[-1])


def test_ratios_are_paired_over_requests() -> None:
    # Paired, every draw's P50 ratio is 0.5 however the draw mixes long and short requests.
    ratio = compare(_steps(1.0, A_TTFT, B_TTFT), (A, B), SLO)["per_rate"][0]["ratio"]
    for key in ("ttft_p50_ms", "ttft_p90_ms"):
        iv = ratio[key]
        assert iv["point"] == pytest.approx(0.5) and iv["units"] == 10
        assert iv["low"] == pytest.approx(0.5) and iv["high"] == pytest.approx(0.5)
    assert ratio["goodput_rps"]["point"] == pytest.approx(1.0)  # all met the SLO


def test_the_aa_is_round_two_over_round_one_as_the_drift() -> None:
    s = compare(_steps(1.0, A_TTFT, B_TTFT, drift=1.25), (A, B), SLO)
    for system in (A, B):
        iv = s["per_rate"][0]["aa"][system]["ttft_p50_ms"]
        assert iv["point"] == pytest.approx(1.25) and iv["low"] == pytest.approx(1.25)
    assert s["drift"][A] == pytest.approx([1.0, 1.25])


def test_the_knee_ratio_comes_with_its_interval() -> None:
    # At 2/s A meets the SLO (TTFT <= 0.3 s) on every request, B on none.
    slow = [0.5] * 10
    steps = _steps(1.0, A_TTFT, B_TTFT) + _steps(2.0, A_TTFT, slow)
    s = compare(steps, (A, B), SLO)
    assert s["knee"] == {A: 2.0, B: 1.0}
    iv = s["knee_ratio"]
    assert (iv["point"], iv["low"], iv["high"]) == (2.0, 2.0, 2.0)
    assert s["per_rate"][1]["ratio"]["ttft_p50_ms"]["point"] == pytest.approx(0.0525 / 0.5)


def test_a_knee_decided_by_one_request_has_a_wide_interval() -> None:
    # At 2/s A meets the SLO on 9 of 10 requests (90%: its knee), but a draw holding request 9
    # twice or more falls under 90%: the knee ratio's interval reaches down to 1.
    slow = [0.5] * 10
    a_at_2 = [*A_TTFT[:9], 0.5]
    s = compare(_steps(1.0, A_TTFT, B_TTFT) + _steps(2.0, a_at_2, slow), (A, B), SLO)
    iv = s["knee_ratio"]
    assert (iv["point"], iv["low"], iv["high"]) == (2.0, 1.0, 2.0)


def test_a_single_steps_ttft_ratio_gets_its_paired_interval() -> None:
    # The docs' tables of runs made before the rounds: one step a system, no SLO needed.
    a, b = _step(1.0, A, 0, A_TTFT), _step(1.0, B, 0, B_TTFT)
    iv = ttft_interval([a], [b], 90)
    assert iv is not None and iv.units == 10
    assert (iv.point, iv.low, iv.high) == pytest.approx((0.5, 0.5, 0.5))
