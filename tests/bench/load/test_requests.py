"""``bench load``'s requests a rate: exactly a round's worth, the same requests at every rate;
and the run's estimate from the unloaded service time."""

from __future__ import annotations

import pytest

from app.bench.core.workload import Lengths
from app.bench.load.bench import STEP_OVERHEAD_S, LoadOptions, estimate_s, rung_requests
from app.errors import ConfigError


def test_a_round_sends_exactly_its_share_of_the_requests() -> None:
    opts = LoadOptions()
    assert (opts.requests, opts.rounds, opts.per_round) == (40, 2, 20)
    for rate in (0.05, 1.0, 50.0):  # 50/s: many more than 20 arrive within the 1 s schedule
        assert len(rung_requests(rate, opts.per_round, 0, Lengths())) == 20


def test_every_rate_sends_the_same_requests_closer_together() -> None:
    slow, fast = (rung_requests(r, 20, 0, Lengths()) for r in (0.5, 2.0))
    assert [(q.prompt_tokens, q.max_tokens) for q in slow] == [
        (q.prompt_tokens, q.max_tokens) for q in fast
    ]
    assert slow[-1].at_s == pytest.approx(4 * fast[-1].at_s)


def test_fewer_than_two_rounds_or_a_round_without_a_request_is_refused() -> None:
    with pytest.raises(ConfigError, match="at least 2 rounds"):
        LoadOptions(rounds=1).check()
    with pytest.raises(ConfigError, match="a request a round"):
        LoadOptions(requests=1, rounds=2).check()


def test_the_estimate_is_the_arrivals_span_or_a_service_time_a_request() -> None:
    # Service 2 s: 0.25/s spans 4 s a request, 1/s is past the service rate (2 s a request);
    # and 2 rates x 2 rounds of steps' overhead, per system.
    assert estimate_s(2.0, (0.25, 1.0), 10, 2) == 2 * (10 * 4 + 10 * 2 + 4 * STEP_OVERHEAD_S)
