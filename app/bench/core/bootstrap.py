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
    if not 0 < level < 1:
        raise ConfigError(f"level must be in (0, 1), got {level}")
    if resamples < 1:
        raise ConfigError(f"resamples must be at least 1, got {resamples}")
    units = sorted((u for u in a if a[u] and b.get(u)), key=repr)
    if not units:
        return None
    point = _ratio(stat(_pooled(a, units)), stat(_pooled(b, units)))
    if len(units) < 2:
        return Interval(point, None, None, level, len(units), 0)
    rng = random.Random(seed)
    draws = []
    for _ in range(resamples):
        pick = [units[rng.randrange(len(units))] for _ in units]
        draws.append(_ratio(stat(_pooled(a, pick)), stat(_pooled(b, pick))))
    draws.sort()
    tail = (1 - level) / 2
    return Interval(point, _at(draws, tail), _at(draws, 1 - tail), level, len(units), resamples)


def _ratio(x: float, y: float) -> float:
    return x / y if y else float("inf")


def _at(sorted_draws: Sequence[float], q: float) -> float:
    """The ``q`` quantile of the draws, linear between neighbours."""
    pos = q * (len(sorted_draws) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_draws) - 1)
    return sorted_draws[lo] + (sorted_draws[hi] - sorted_draws[lo]) * (pos - lo)
