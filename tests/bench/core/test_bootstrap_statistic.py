"""The bootstrap of any statistic over paired units (requests), and of a ratio of two
unpaired samples: undefined draws left out, percentile bounds around the point."""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence

import pytest

from app.bench.core.bootstrap import paired_interval, unpaired_ratio_interval
from app.errors import ConfigError


def test_a_paired_statistic_constant_over_units_has_a_zero_width_interval() -> None:
    a = {i: 10.0 * (i + 1) for i in range(8)}

    def ratio(pick: Sequence[int]) -> float | None:
        return sum(a[i] / 2 for i in pick) / sum(a[i] for i in pick)

    iv = paired_interval(list(a), ratio)
    assert iv is not None
    assert (iv.point, iv.low, iv.high, iv.units, iv.resamples) == (0.5, 0.5, 0.5, 8, 2000)


def test_undefined_draws_are_left_out_and_counted() -> None:
    # Undefined when the draw holds unit 0 (about 66% of draws of 10): fewer than half are
    # defined, so no interval; the point is over all units, also undefined: None.
    def stat(pick: Sequence[int]) -> float | None:
        return None if 0 in pick else float(len(set(pick)))

    assert paired_interval(list(range(10)), stat) is None
    iv = paired_interval(list(range(1, 11)), lambda p: None if p.count(1) > 2 else 1.0)
    assert iv is not None and iv.low == 1.0 and 1500 < iv.resamples < 2000


def test_no_interval_under_half_defined_draws() -> None:
    iv = paired_interval(list(range(10)), lambda p: 1.0 if len(set(p)) == 10 else None)
    assert iv is not None and iv.point == 1.0 and iv.low is None and iv.high is None


def test_unpaired_interval_covers_the_point_and_narrows_with_samples() -> None:
    rng = random.Random(3)

    def width(n: int) -> float:
        a = [rng.gauss(80, 15) for _ in range(n)]
        b = [rng.gauss(100, 15) for _ in range(n)]
        iv = unpaired_ratio_interval(a, b, resamples=1000)
        assert iv is not None and iv.low is not None and iv.high is not None
        assert iv.low <= iv.point <= iv.high
        assert iv.point == statistics.median(a) / statistics.median(b)
        return iv.high - iv.low

    assert width(400) < width(10)


def test_unpaired_needs_both_arms_and_a_valid_level() -> None:
    assert unpaired_ratio_interval([], [1.0]) is None
    iv = unpaired_ratio_interval([1.0], [2.0])
    assert iv is not None and (iv.point, iv.low, iv.units) == (0.5, None, 1)
    with pytest.raises(ConfigError, match="level"):
        unpaired_ratio_interval([1.0], [1.0], level=1.0)
    with pytest.raises(ConfigError, match="resamples"):
        paired_interval([1, 2], lambda p: 1.0, resamples=0)
