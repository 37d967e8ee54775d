"""``bench load``'s request sequence: one per seed, Poisson arrivals, lengths in their bounds."""

from __future__ import annotations

import itertools
import statistics

import pytest

from app.bench.core.workload import Lengths, schedule
from app.errors import ConfigError

L = Lengths()


def test_the_same_seed_gives_the_same_sequence() -> None:
    assert schedule(2.0, 30.0, 7, L) == schedule(2.0, 30.0, 7, L)


def test_different_seeds_give_different_sequences() -> None:
    a, b = schedule(2.0, 30.0, 7, L), schedule(2.0, 30.0, 8, L)
    assert [r.at_s for r in a] != [r.at_s for r in b]
    assert [r.prompt_tokens for r in a] != [r.prompt_tokens for r in b]


def test_a_higher_rate_sends_the_same_requests_closer_together() -> None:
    """The ladder's rungs differ only in load: one rung drawing longer prompts than the next
    made the SLO's attainment rise with the rate in a full run."""
    slow, fast = schedule(0.1, 120.0, 3, L, min_requests=8), schedule(0.3, 120.0, 3, L)
    assert len(fast) > len(slow) >= 8
    common = fast[: len(slow)]
    lengths = [(r.prompt_tokens, r.max_tokens) for r in slow]
    assert lengths == [(r.prompt_tokens, r.max_tokens) for r in common]
    assert [r.at_s for r in common] == pytest.approx([r.at_s / 3 for r in slow])


def test_arrivals_average_the_rate_over_the_duration() -> None:
    reqs = schedule(5.0, 400.0, 1, L)
    assert len(reqs) == pytest.approx(2000, rel=0.1)
    gaps = [b.at_s - a.at_s for a, b in itertools.pairwise(reqs)]
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.1)
    assert all(r.at_s < 400.0 for r in reqs) and list(reqs) == sorted(reqs, key=lambda r: r.at_s)


def test_lengths_are_long_tailed_and_clipped() -> None:
    reqs = schedule(5.0, 400.0, 2, L)
    prompts = [r.prompt_tokens for r in reqs]
    assert min(prompts) >= 128 and max(prompts) <= 8192
    assert statistics.median(prompts) == pytest.approx(1024, rel=0.1)
    assert statistics.fmean(prompts) > statistics.median(prompts)  # the long tail
    outs = [r.max_tokens for r in reqs]
    assert min(outs) == 16 and max(outs) == 128


def test_a_short_step_still_has_its_minimum_of_requests() -> None:
    assert len(schedule(0.01, 1.0, 3, L, min_requests=4)) == 4


def test_no_rate_no_schedule() -> None:
    with pytest.raises(ConfigError):
        schedule(0.0, 10.0, 0, L)


def test_lengths_fit_the_models_max_length() -> None:
    fit = L.fit(4096)
    assert fit.hi + fit.out_hi + 64 == 4096
    assert fit.median == int(1024 * fit.hi / 8192)  # the shape scaled down with the clip
    assert L.fit(16384) == L  # room enough: unchanged
