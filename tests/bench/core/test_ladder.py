"""``bench load``'s ladder of rates scales with the unloaded service time it was measured from."""

from __future__ import annotations

import pytest

from app.bench.core.workload import ladder
from app.errors import ConfigError

FRACTIONS = (0.25, 0.5, 1.0, 2.0)


def test_rates_are_fractions_of_the_unloaded_service_rate() -> None:
    assert ladder(0.5, FRACTIONS) == (0.5, 1.0, 2.0, 4.0)


def test_a_machine_twice_as_slow_gets_half_the_rates() -> None:
    fast, slow = ladder(0.4, FRACTIONS), ladder(0.8, FRACTIONS)
    assert [f / s for f, s in zip(fast, slow, strict=True)] == pytest.approx([2.0] * 4, rel=0.01)


def test_rates_are_sorted_unique_and_rounded() -> None:
    assert ladder(3.0, (1.0, 0.5, 1.0)) == (0.167, 0.333)


@pytest.mark.parametrize("service", [0.0, -1.0, float("nan"), float("inf")])
def test_no_service_time_no_ladder(service: float) -> None:
    with pytest.raises(ConfigError):
        ladder(service, FRACTIONS)
