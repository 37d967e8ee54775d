"""The bootstrap interval of a ratio of P50s: paired over conversations (clusters), percentile
bounds, a point estimate over every sample."""

from __future__ import annotations

import random
import statistics

import pytest

from app.bench.core.bootstrap import ratio_interval
from app.errors import ConfigError


def test_identical_systems_give_one_with_a_zero_width_interval() -> None:
    a = {c: [100.0 + c, 200.0 + c] for c in range(6)}
    iv = ratio_interval(a, dict(a))
    assert iv is not None
    assert (iv.point, iv.low, iv.high, iv.units) == (1.0, 1.0, 1.0, 6)


def test_the_point_is_the_ratio_of_pooled_medians() -> None:
    a = {0: [1.0, 3.0], 1: [5.0]}
    b = {0: [2.0], 1: [4.0, 6.0]}
    iv = ratio_interval(a, b)
    assert iv is not None
    assert iv.point == statistics.median([1, 3, 5]) / statistics.median([2, 4, 6])


def test_pairing_cancels_what_conversations_share() -> None:
    """Conversations differ 10x in length, and A is 0.5x B in each: paired, every draw is 0.5;
    unpaired resampling would spread the ratio over the conversations' spread."""
    a = {c: [50.0 * 10**c] for c in range(4)}
    b = {c: [100.0 * 10**c] for c in range(4)}
    iv = ratio_interval(a, b)
    assert iv is not None
    assert iv.low == pytest.approx(0.5) and iv.high == pytest.approx(0.5)


def test_the_interval_covers_the_point_and_narrows_with_more_conversations() -> None:
    rng = random.Random(1)

    def widths(n: int) -> float:
        a = {c: [rng.gauss(80, 15) for _ in range(2)] for c in range(n)}
        b = {c: [rng.gauss(100, 15) for _ in range(2)] for c in range(n)}
        iv = ratio_interval(a, b, resamples=1000)
        assert iv is not None and iv.low is not None and iv.high is not None
        assert iv.low <= iv.point <= iv.high
        return iv.high - iv.low

    assert widths(60) < widths(6)


def test_the_level_sets_the_percentiles() -> None:
    a = {c: [float(c + 1)] for c in range(10)}
    b = {c: [1.0] for c in range(10)}
    wide = ratio_interval(a, b, level=0.98)
    narrow = ratio_interval(a, b, level=0.5)
    assert wide is not None and narrow is not None
    assert wide.low is not None and narrow.low is not None
    assert wide.high is not None and narrow.high is not None
    assert wide.low < narrow.low < narrow.high < wide.high


def test_only_shared_conversations_count_and_one_gives_no_interval() -> None:
    a = {0: [1.0], 1: [2.0]}
    b = {1: [4.0], 2: [8.0]}
    iv = ratio_interval(a, b)
    assert iv is not None
    assert (iv.point, iv.low, iv.high, iv.units) == (0.5, None, None, 1)
    assert ratio_interval({0: [1.0]}, {1: [1.0]}) is None


def test_refuses_a_level_outside_zero_one() -> None:
    with pytest.raises(ConfigError, match="level"):
        ratio_interval({0: [1.0]}, {0: [1.0]}, level=90)
