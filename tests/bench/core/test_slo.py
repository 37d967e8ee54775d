"""``bench load``'s SLO, derived from the unloaded run: prefill(n) fit, TPOT from the median."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from app.bench.core.slo import SloFactors, derive_slo, fit_line, percentile
from app.bench.faults.plan import FaultOptions
from app.bench.load.bench import LoadOptions
from app.errors import ConfigError


def test_prefill_line_is_fit_through_the_unloaded_points() -> None:
    a, b = fit_line([(100, 0.02), (500, 0.06), (1000, 0.11)])
    assert b == pytest.approx(0.0001, rel=0.01)
    assert a == pytest.approx(0.01, abs=0.001)


def test_a_single_length_gives_a_flat_line_and_slope_is_never_negative() -> None:
    assert fit_line([(256, 0.05), (256, 0.07)]) == pytest.approx((0.06, 0.0))
    assert fit_line([(100, 0.09), (1000, 0.05)])[1] == 0.0


def test_slo_from_both_systems_unloaded_requests() -> None:
    rows = [
        {"prompt_tokens": 100, "p_prefill_s": 0.02, "tpot_s": 0.010},
        {"prompt_tokens": 1000, "p_prefill_s": 0.11, "tpot_s": 0.012},
        {"prompt_tokens": 100, "p_prefill_s": 0.02, "tpot_s": 0.030},
    ]
    slo = derive_slo(rows)
    assert slo.tpot_s == 0.012 and slo.tpot_limit_s == pytest.approx(0.018)
    assert slo.ttft_limit_s(1000) == pytest.approx(2 * 0.11 + 0.1, rel=0.02)
    assert "TTFT <=" in slo.describe() and "TPOT <=" in slo.describe()


def test_the_factors_widen_the_slo_and_survive_the_options_json() -> None:
    rows = [
        {"prompt_tokens": 100, "p_prefill_s": 0.02, "tpot_s": 0.010},
        {"prompt_tokens": 1000, "p_prefill_s": 0.11, "tpot_s": 0.010},
    ]
    slo = derive_slo(rows, SloFactors(ttft=3.0, ttft_slack_s=0.2, tpot=4.0))
    assert slo.tpot_limit_s == pytest.approx(0.040)
    assert slo.ttft_limit_s(1000) == pytest.approx(3 * 0.11 + 0.2, rel=0.02)
    factors = SloFactors(tpot=3.0)
    for cls in (LoadOptions, FaultOptions):
        opts = cls(slo=factors)
        assert cls.from_json(json.dumps(asdict(opts))).slo == factors


def test_a_factor_below_one_is_refused_with_what_was_given() -> None:
    with pytest.raises(ConfigError, match=r"tpot 0\.5"):
        SloFactors(tpot=0.5)


def test_no_unloaded_request_no_slo() -> None:
    with pytest.raises(ConfigError):
        derive_slo([])


def test_percentile_interpolates_and_ignores_nan() -> None:
    assert percentile([1, 2, 3, 4, float("nan")], 50) == 2.5
    assert percentile(range(1, 101), 99) == pytest.approx(99.01)
    assert percentile([], 90) is None
