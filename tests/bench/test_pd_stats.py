"""``bench pd``'s pure logic: workloads, order rotation, link rate, histograms, medians/ratios."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest

from app.bench.pd_stats import (
    METRICS,
    Workload,
    calibrate,
    default_burst,
    link_rate_bps,
    p_times,
    parse_histograms,
    parse_rate,
    parse_size,
    parse_workloads,
    summarize,
    trial_order,
)
from app.errors import ConfigError

A, B = "kv-sidecar", "mooncake"


def test_workloads_parse_sizes_and_concurrency() -> None:
    ws = parse_workloads("512,2k,8K", "4x2k")
    assert ws == (Workload(512), Workload(2048), Workload(8192), Workload(2048, 4))
    assert [w.name for w in ws] == ["512", "2k", "8k", "4x2k"]
    assert parse_workloads("", "2x512") == (Workload(512, 2),)
    for bad in (("", ""), ("abc", ""), ("512", "4y2k"), ("512", "0x2k")):
        with pytest.raises(ConfigError):
            parse_workloads(*bad)


def test_systems_alternate_and_the_first_rotates() -> None:
    ws = (Workload(512), Workload(2048))
    order = trial_order(ws, (A, B), reps=4)
    assert len(order) == 4 * 2 * 2
    # Trial by trial the systems alternate within a workload...
    for i in range(0, len(order), 2):
        assert {order[i].system, order[i + 1].system} == {A, B}
        assert order[i].workload == order[i + 1].workload
    # ...and who goes first rotates with the repetition and the workload.
    firsts = [(t.rep, t.workload.name, t.system) for t in order[::2]]
    assert firsts[:4] == [(0, "512", A), (0, "2k", B), (1, "512", B), (1, "2k", A)]
    per = Counter((t.workload, t.system) for t in order[::2])
    assert set(per.values()) == {2}  # each system first equally often per workload


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


def _trial(system: str, workload: str, counted: bool = True, **m: float) -> dict[str, Any]:
    base = dict.fromkeys(METRICS, 1.0)
    return {
        "link": "unshaped",
        "workload": workload,
        "system": system,
        "concurrency": 4 if "x" in workload else 1,
        "counted": counted,
        **base,
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
    cal = calibrate(trials)
    assert set(cal["per_workload"]) == {"512", "2k"}
    assert cal["per_workload"]["512"]["bytes"] == 2e6
    assert cal["per_workload"]["512"]["rate_bps"] == pytest.approx(2e6 * 8 / (0.25 * 0.2))
    assert cal["rate_bps"] == pytest.approx((2e6 * 8 / (0.25 * 0.2) + 4e6 * 8 / (0.25 * 0.4)) / 2)


def test_summary_medians_ratios_and_uncounted_trials() -> None:
    trials = [
        _trial(A, "512", ttft_ms=10),
        _trial(A, "512", ttft_ms=30),
        _trial(A, "512", ttft_ms=20),
        _trial(A, "512", counted=False, ttft_ms=1000),
        _trial(B, "512", ttft_ms=40),
        _trial(B, "512", ttft_ms=float("nan")),  # not observed: not a value
    ]
    for t in trials:
        t["exposed_ms"] = -5.0 if t["system"] == A else 10.0
    rows = {r["metric"]: r for r in summarize(trials, (A, B))}
    assert rows["ttft_ms"][A] == 20 and rows["ttft_ms"][B] == 40
    assert rows["ttft_ms"]["ratio"] == pytest.approx(0.5)
    assert rows["ttft_ms"][f"{A}_n"] == 3 and rows["ttft_ms"][f"{B}_n"] == 2
    assert set(rows) == set(METRICS)
    # KV at D before P's answer (negative) has a median but no ratio.
    assert rows["exposed_ms"][A] == -5.0 and rows["exposed_ms"]["ratio"] is None


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
