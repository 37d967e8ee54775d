"""The interleaved schedule of side-by-side benches: alternating blocks, every system at the same
mean position in time, at least two rounds (the A/A)."""

from __future__ import annotations

import pytest

from app.bench.core.interleave import Block, abba, mean_position
from app.errors import ConfigError


def test_two_systems_two_rounds_run_abba() -> None:
    assert [(b.system, b.round) for b in abba(["a", "b"], 2)] == [
        ("a", 0),
        ("b", 0),
        ("b", 1),
        ("a", 1),
    ]


def test_three_systems_four_rounds_alternate_and_balance() -> None:
    blocks = abba(["a", "b", "c"], 4)
    assert "".join(b.system for b in blocks) == "abccbaabccba"
    assert [b.round for b in blocks if b.system == "c"] == [0, 1, 2, 3]
    assert {mean_position(blocks, s) for s in "abc"} == {5.5}


def test_every_round_visits_every_system_once() -> None:
    blocks = abba(["a", "b", "c"], 3)
    for r in range(3):
        assert sorted(b.system for b in blocks if b.round == r) == ["a", "b", "c"]
    assert blocks[2:4] == [Block("c", 0), Block("c", 1)]


@pytest.mark.parametrize(
    ("systems", "rounds", "message"),
    [
        (["a", "b"], 1, "at least 2"),
        ([], 2, "at least one system"),
        (["a", "a"], 2, "each system once"),
    ],
)
def test_refuses_a_schedule_without_an_aa_or_with_a_system_twice(
    systems: list[str], rounds: int, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        abba(systems, rounds)


def test_mean_position_of_a_system_not_run_is_an_error() -> None:
    with pytest.raises(ConfigError, match="not in the schedule"):
        mean_position(abba(["a"], 2), "b")
