"""Bootstrap intervals for the ratios benches report (issue 52, item 3).

A ratio compares a statistic (a P50) of system A's samples with B's. The samples are not
independent: the turns of one conversation share its history, its lengths, its engine state.
So the unit resampled is the conversation (a cluster), and the two systems are resampled
together (paired: the same conversations, drawn alike, for A and B), as both ran the same
conversations. The interval is the percentile one over ``resamples`` draws.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from app.errors import ConfigError

K = TypeVar("K", bound=Hashable)  # a cluster: a conversation
LEVEL = 0.9
RESAMPLES = 2000


@dataclass(frozen=True)
class Interval:
    """``point``: the ratio over all samples; [``low``, ``high``]: its ``level`` bootstrap
    interval over ``units`` resampled clusters (None: fewer than two units, no interval)."""

    point: float
    low: float | None
    high: float | None
    level: float
    units: int
    resamples: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pooled(by_unit: Mapping[K, Sequence[float]], units: Sequence[K]) -> list[float]:
    return [v for u in units for v in by_unit[u]]


def ratio_interval(
    a: Mapping[K, Sequence[float]],
    b: Mapping[K, Sequence[float]],
    stat: Callable[[Sequence[float]], float] = statistics.median,
    level: float = LEVEL,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> Interval | None:
    """``stat(A) / stat(B)`` over the units (conversations) both have samples of, and its
    paired cluster bootstrap interval; None when they share no unit."""
    units = sorted((u for u in a if a[u] and b.get(u)), key=repr)

    def ratio(pick: Sequence[K]) -> float:
        return _ratio(stat(_pooled(a, pick)), stat(_pooled(b, pick)))

    return paired_interval(units, ratio, level, resamples, seed)


def paired_interval(
    units: Sequence[K],
    statistic: Callable[[Sequence[K]], float | None],
    level: float = LEVEL,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> Interval | None:
    """``statistic(units)`` and its percentile bootstrap interval over ``units`` drawn with
    replacement: paired when the statistic compares two systems on the same units (requests,
    conversations). A draw whose statistic is undefined (None: a knee neither system reached)
    is left out, and ``resamples`` counts the defined ones; no interval when under half are.
    None when there is no unit or the statistic is undefined over all of them."""
    if not 0 < level < 1:
        raise ConfigError(f"level must be in (0, 1), got {level}")
    if resamples < 1:
        raise ConfigError(f"resamples must be at least 1, got {resamples}")
    units = list(units)
    point = statistic(units) if units else None
    if point is None:
        return None
    if len(units) < 2:
        return Interval(point, None, None, level, len(units), 0)
    rng = random.Random(seed)
    draws = []
    for _ in range(resamples):
        pick = [units[rng.randrange(len(units))] for _ in units]
        if (v := statistic(pick)) is not None:
            draws.append(v)
    if 2 * len(draws) < resamples:
        return Interval(point, None, None, level, len(units), len(draws))
    draws.sort()
    tail = (1 - level) / 2
    return Interval(point, _at(draws, tail), _at(draws, 1 - tail), level, len(units), len(draws))


def unpaired_ratio_interval(
    a: Sequence[float],
    b: Sequence[float],
    stat: Callable[[Sequence[float]], float] = statistics.median,
    level: float = LEVEL,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> Interval | None:
    """``stat(a) / stat(b)`` for two samples of different units (each arm resampled alone);
    None when either is empty. ``units``: the smaller arm's size."""
    if not a or not b:
        return None
    if not 0 < level < 1:
        raise ConfigError(f"level must be in (0, 1), got {level}")
    if resamples < 1:
        raise ConfigError(f"resamples must be at least 1, got {resamples}")
    point = _ratio(stat(a), stat(b))
    n = min(len(a), len(b))
    if n < 2:
        return Interval(point, None, None, level, n, 0)
    rng = random.Random(seed)
    draws = sorted(
        _ratio(stat(rng.choices(a, k=len(a))), stat(rng.choices(b, k=len(b))))
        for _ in range(resamples)
    )
    tail = (1 - level) / 2
    return Interval(point, _at(draws, tail), _at(draws, 1 - tail), level, n, resamples)


def _ratio(x: float, y: float) -> float:
    return x / y if y else float("inf")


def _at(sorted_draws: Sequence[float], q: float) -> float:
    """The ``q`` quantile of the draws, linear between neighbours."""
    pos = q * (len(sorted_draws) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_draws) - 1)
    return sorted_draws[lo] + (sorted_draws[hi] - sorted_draws[lo]) * (pos - lo)
