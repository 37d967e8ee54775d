"""``bench load``'s goodput counts only the requests that completed and met both SLOs."""

from __future__ import annotations

from typing import Any

import pytest

from app.bench.core.slo import Slo, judge
from app.bench.load.stats import step_figures

# Prefill(n) = 10 ms + 0.1 ms/token: TTFT limit at 100 tokens = 2 x 20 ms + 100 ms = 140 ms;
# TPOT limit = 1.5 x 20 ms = 30 ms.
SLO = Slo(prefill_a_s=0.010, prefill_b_s=0.0001, tpot_s=0.020)


def _req(sent: float, ttft: float, tpot: float, n: int = 11, **kw: Any) -> dict[str, Any]:
    first = sent + ttft
    last = first + tpot * (n - 1)
    r = {"sent": sent, "first": first, "last": last, "tokens": list(range(n))}
    return r | {"prompt_tokens": 100, "max_tokens": 11, "error": None, "ended": last} | kw


def test_limits_follow_the_prompt_length() -> None:
    assert SLO.ttft_limit_s(100) == pytest.approx(0.140)
    assert SLO.ttft_limit_s(1000) == pytest.approx(0.320)
    assert SLO.tpot_limit_s == pytest.approx(0.030)


def test_a_request_is_good_only_when_it_meets_both() -> None:
    assert judge(_req(0, 0.100, 0.020), SLO)["good"]
    slow_first = judge(_req(0, 0.200, 0.020), SLO)
    assert not slow_first["good"] and not slow_first["ttft_ok"] and slow_first["tpot_ok"]
    slow_tokens = judge(_req(0, 0.100, 0.040), SLO)
    assert not slow_tokens["good"] and slow_tokens["ttft_ok"] and not slow_tokens["tpot_ok"]


def test_an_unfinished_request_is_never_good() -> None:
    cut = _req(0, 0.100, 0.020, n=5)  # 5 of 11 tokens
    assert not judge(cut, SLO)["completed"] and not judge(cut, SLO)["good"]
    failed = _req(0, 0.100, 0.020, error="cancelled")
    assert not judge(failed, SLO)["good"]


def test_goodput_counts_good_requests_over_the_steps_span() -> None:
    reqs = [
        _req(0.0, 0.100, 0.020),  # good, ends at 0.3
        _req(1.0, 0.200, 0.020),  # TTFT missed
        _req(2.0, 0.100, 0.040),  # TPOT missed
        _req(3.0, 0.100, 0.020),  # good, ends at 3.3
    ]
    f = step_figures(reqs, SLO)
    assert f["span_s"] == pytest.approx(3.3)
    assert f["good"] == 2 and f["completed"] == 4
    assert f["goodput_rps"] == pytest.approx(2 / 3.3)
    assert f["throughput_rps"] == pytest.approx(4 / 3.3)
    assert f["attainment"] == pytest.approx(0.5)
    assert f["goodput_rps"] <= f["throughput_rps"]


def test_percentiles_of_a_step() -> None:
    reqs = [_req(float(i), 0.010 * (i + 1), 0.020) for i in range(10)]
    f = step_figures(reqs, SLO)
    assert f["ttft_p50_ms"] == pytest.approx(55.0)
    assert f["ttft_p90_ms"] == pytest.approx(91.0)
    assert f["tpot_p50_ms"] == pytest.approx(20.0)
