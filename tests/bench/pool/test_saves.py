"""The running pool stores' cost report (issue 54): the ratio and its interval, bytes a token."""

from __future__ import annotations

import random

from app.bench.pool.saves import Sample, ratio_interval, summary


def test_a_slower_arm_is_told_apart_and_equal_arms_are_not() -> None:
    rng = random.Random(1)
    off = [10 + rng.gauss(0, 0.3) for _ in range(40)]
    same = [10 + rng.gauss(0, 0.3) for _ in range(40)]
    slower = [11 + rng.gauss(0, 0.3) for _ in range(40)]
    point, lo, hi = ratio_interval(same, off)
    assert lo < 1 < hi and abs(point - 1) < 0.02
    point, lo, hi = ratio_interval(slower, off)
    assert 1.05 < lo < point < hi < 1.15


def test_bytes_are_per_generated_token_of_each_arm() -> None:
    samples = [
        Sample("gemma3", "off", 0, 10.0, 100, 0.0),
        Sample("gemma3", "on", 1, 11.0, 100, 4096.0),
        Sample("gemma3", "on", 2, 11.0, 300, 12288.0),
        Sample("gemma3", "off", 3, 10.0, 100, 1024.0),
    ]
    s = summary(samples)["gemma3"]
    assert (s["put_bytes_per_token_off"], s["put_bytes_per_token_on"]) == (5.12, 40.96)
    assert s["ratio"] == 1.1 and (s["step_ms_off"], s["step_ms_on"]) == (10.0, 11.0)
