"""What the real-engine benches share (``core.stats``), pure: link rate, histograms, spreads,
references, failed loads from decode's computed tokens, engine steps."""

from __future__ import annotations

import math
from typing import Any

import pytest

from app.bench.core.stats import (
    Iteration,
    calibrate_link,
    default_burst,
    failed_loads,
    link_rate_bps,
    match_reference,
    p_times,
    parse_histograms,
    parse_iterations,
    parse_rate,
    parse_size,
    spread,
    step_periods,
)
from app.errors import ConfigError

A, B = "kv-sidecar", "mooncake"


def test_rate_gives_the_transfer_a_quarter_of_prefill() -> None:
    rate = link_rate_bps(10_000_000, 2.0)
    assert rate == pytest.approx(10_000_000 * 8 / 0.5)
    assert 10_000_000 * 8 / rate == pytest.approx(0.25 * 2.0)  # the transfer time
    with pytest.raises(ConfigError):
        link_rate_bps(0, 1.0)
    assert default_burst(1e6) == 128 << 10  # never below a loopback packet's size
    assert default_burst(8e9) == int(8e9 / 8 * 0.005)


def test_rate_and_burst_units() -> None:
    assert parse_rate("800mbit") == 800e6
    assert parse_rate("1.5gbit") == 1.5e9
    assert parse_rate("2000") == 2000
    assert parse_size("256kb") == 256 << 10
    assert parse_size("1mb") == 1 << 20
    with pytest.raises(ConfigError):
        parse_rate("fast")


def _trial(
    system: str, workload: str, counted: bool = True, rep: int = 0, **m: float
) -> dict[str, Any]:
    """A trial as much as calibration reads of it."""
    return {
        "link": "unshaped",
        "workload": workload,
        "system": system,
        "rep": rep,
        "concurrency": 4 if "x" in workload else 1,
        "counted": counted,
        **m,
    }


def test_calibration_takes_median_bytes_and_prefill_over_both_systems() -> None:
    trials = [
        _trial(A, "512", bytes=1e6, p_prefill_ms=100),
        _trial(B, "512", bytes=3e6, p_prefill_ms=300),
        _trial(A, "2k", bytes=4e6, p_prefill_ms=400),
        _trial(B, "2k", bytes=4e6, p_prefill_ms=400),
        _trial(A, "4x2k", bytes=99e6, p_prefill_ms=1),  # concurrent: not a calibration point
        _trial(B, "2k", counted=False, bytes=1, p_prefill_ms=1),  # wrong output: left out
    ]
    cal = calibrate_link(trials)
    assert set(cal["per_workload"]) == {"512", "2k"}
    assert cal["per_workload"]["512"]["bytes"] == 2e6
    assert cal["per_workload"]["512"]["rate_bps"] == pytest.approx(2e6 * 8 / (0.25 * 0.2))
    assert cal["rate_bps"] == pytest.approx((2e6 * 8 / (0.25 * 0.2) + 4e6 * 8 / (0.25 * 0.4)) / 2)


def test_spread_of_nothing_and_of_values() -> None:
    assert spread([]) == {"min": None, "median": None, "max": None, "n": 0}
    assert spread([float("nan")])["n"] == 0
    assert spread([3.0, 1.0, 2.0, 10.0]) == {"min": 1.0, "median": 2.5, "max": 10.0, "n": 4}


def test_references_are_the_same_set_for_both_systems() -> None:
    refs = {"n-1": [1, 2, 3], "n": [1, 2, 4]}
    assert match_reference([1, 2, 3], refs) == "n-1"  # kv-sidecar's rounding
    assert match_reference([1, 2, 4], refs) == "n"  # Mooncake's (a prefill of N)
    assert match_reference([1, 9, 9], refs) is None  # wrong KV: neither
    assert match_reference([], refs) is None


def test_failed_loads_from_what_decode_computed() -> None:
    # Loaded: decode computes the last token of each prompt (or a block's tail).
    assert failed_loads(1, 512, 1) == 0
    assert failed_loads(4 * 15, 2048, 4) == 0
    # Recomputed: the whole prompt, or from the first bad block on.
    assert failed_loads(512, 512, 1) == 1
    assert failed_loads(400, 512, 1) == 1
    assert failed_loads(3 + 2048, 2048, 4) == 1  # one of four, three loaded
    assert failed_loads(2 * 2048 + 2 * 16, 2048, 4) == 2
    assert failed_loads(4 * 2048, 2048, 4) == 4
    assert failed_loads(10**6, 512, 1) == 1  # never more than the trial's prompts
    assert failed_loads(0, 0, 0) == 0


def test_iteration_lines_parse_from_the_engine_log() -> None:
    log = "\n".join(
        [
            "1764237600.123456 WARNING vllm.foo: something else",
            "1764237600.500000 INFO vllm.v1.metrics.loggers: Iteration(7): 1 context requests, "
            "512 context tokens, 0 generation requests, 0 generation tokens, iteration elapsed "
            "time: 12.00 ms, CPU KV cache usage: 1.0%",
            "1764237600.600000 INFO vllm.v1.metrics.loggers: Engine 000: Iteration(8): 0 context "
            "requests, 0 context tokens, 4 generation requests, 4 generation tokens, ...",
        ]
    )
    assert parse_iterations(log) == [
        Iteration(1764237600.5, 1, 512, 0, 0, 12.0),
        Iteration(1764237600.6, 0, 0, 4, 4),  # a line without the elapsed time still parses
    ]


def test_histogram_deltas_give_per_request_p_times() -> None:
    def page(e2e: float, inf: float, pre: float, n: int) -> str:
        lab = '{engine="0",model_name="tiny"}'
        return "\n".join(
            [
                "# HELP vllm:e2e_request_latency_seconds x",
                f"vllm:e2e_request_latency_seconds_sum{lab} {e2e}",
                f"vllm:e2e_request_latency_seconds_count{lab} {n}",
                f'vllm:e2e_request_latency_seconds_bucket{{le="1.0"}} {n}',
                f"vllm:request_inference_time_seconds_sum{lab} {inf}",
                f"vllm:request_inference_time_seconds_count{lab} {n}",
                f"vllm:request_prefill_time_seconds_sum{lab} {pre}",
                f"vllm:request_prefill_time_seconds_count{lab} {n}",
            ]
        )

    before = parse_histograms(page(1.0, 0.5, 0.4, 2))
    after = parse_histograms(page(2.0, 1.2, 1.0, 4))
    p = p_times(before, after)
    assert p["prefill_s"] == pytest.approx(0.3)
    assert p["arrival_to_step_s"] == pytest.approx((1.0 - 0.7) / 2)
    assert math.isnan(p_times(after, after)["prefill_s"])


def test_step_periods_are_the_gaps_between_logged_steps_inside_the_window() -> None:
    steps = [Iteration(t, 1, 256, 0, 0) for t in (10.0, 10.5, 10.7, 11.5, 14.0)]
    assert step_periods(steps, 10.4, 12.0) == pytest.approx([0.2, 0.8])
    assert step_periods(list(reversed(steps)), 0, 100) == pytest.approx([0.5, 0.2, 0.8, 2.5])
    assert step_periods(steps, 11.0, 12.0) == []  # one step: no period
