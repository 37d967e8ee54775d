"""The push's digest draw (issue 51): the share it is set to, over any run of requests, at
places no period predicts, and one answer per request whatever rank asks."""

from __future__ import annotations

import itertools
import random

import pytest

from app.kvcache.digest import DigestShare


@pytest.mark.parametrize("share", [0.125, 0.3, 0.5])
def test_every_run_of_requests_draws_its_share_within_two(share: float) -> None:
    draw = DigestShare(share, random.Random(7))
    picks = [draw.draw(f"req-{i}") for i in range(2000)]
    for n in (8, 12, 50, 333, 2000):
        for start in range(0, len(picks) - n + 1, max(1, n // 2)):
            assert abs(sum(picks[start : start + n]) - n * share) <= 2, (n, start)


def test_the_places_drawn_are_not_periodic() -> None:
    draw = DigestShare(0.125, random.Random(3))
    drawn = [i for i in range(4000) if draw.draw(f"req-{i}")]
    gaps = {b - a for a, b in itertools.pairwise(drawn)}
    # A fixed period would pick every 8th request, one gap; a workload repeating every 8
    # requests would then never have some of its requests checked.
    assert len(gaps) >= 8
    positions = {i % 8 for i in drawn}
    assert positions == set(range(8))


def test_one_answer_per_request_and_the_ends() -> None:
    draw = DigestShare(0.5, random.Random(1))
    first = [draw.draw(f"r{i}") for i in range(100)]
    assert [draw.draw(f"r{i}") for i in range(100)] == first  # asked again: the same
    off, every = DigestShare(0.0), DigestShare(1.0)
    assert not any(off.draw(f"r{i}") for i in range(100))
    assert all(every.draw(f"r{i}") for i in range(100))


def test_a_changed_share_applies_to_the_next_requests() -> None:
    draw = DigestShare(0.0, random.Random(2))
    assert not any(draw.draw(f"a{i}") for i in range(50))
    draw.set(1.0)
    assert all(draw.draw(f"b{i}") for i in range(50))
    draw.set(0.25)
    assert abs(sum(draw.draw(f"c{i}") for i in range(400)) - 100) <= 2
