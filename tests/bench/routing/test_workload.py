"""``bench routing``'s workload: seeded, tenants share their system prompt, Poisson arrivals
with one burst; and its summary's per-rep ratios."""

from __future__ import annotations

import itertools
import statistics

import pytest

from app.bench.routing.bench import Answer, summarize, tail
from app.bench.routing.workload import Workload, arrivals
from app.errors import ConfigError


def test_the_same_seed_gives_the_same_requests_and_another_seed_others() -> None:
    w = Workload(requests=40, seed=3)
    assert arrivals(w) == arrivals(Workload(requests=40, seed=3))
    assert arrivals(w) != arrivals(Workload(requests=40, seed=4))


def test_a_tenants_requests_share_its_system_prompt_and_differ_after_it() -> None:
    w = Workload(tenants=3, system_tokens=100, suffix_tokens=20, requests=60)
    load = arrivals(w)
    assert all(len(a.tokens) == 120 for a in load)
    by_tenant: dict[int, list[tuple[int, ...]]] = {}
    for a in load:
        by_tenant.setdefault(a.tenant, []).append(a.tokens)
    assert set(by_tenant) == {0, 1, 2}
    for prompts in by_tenant.values():
        assert len({p[:100] for p in prompts}) == 1  # one system prompt per tenant
        assert len({p[100:] for p in prompts}) == len(prompts)  # suffixes of their own
    systems = {prompts[0][:100] for prompts in by_tenant.values()}
    assert len(systems) == 3


def test_arrivals_are_poisson_at_the_rate_with_one_burst() -> None:
    w = Workload(requests=2000, rate_per_s=5.0, burst=50, burst_at=0.5)
    times = [a.at_s for a in arrivals(w)]
    assert times == sorted(times)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    zero = [i for i, g in enumerate(gaps) if g == 0]
    # The burst: 49 requests at the time of its first, half-way through.
    assert len(zero) == 49 and zero == list(range(zero[0], zero[0] + 49))
    assert abs(zero[0] - 975) <= 1
    # Flagged: the burst's first request (the one before the zero gaps) and the 49 after it.
    flagged = [i for i, a in enumerate(arrivals(w)) if a.burst]
    assert flagged == list(range(zero[0], zero[0] + 50))
    spaced = [g for g in gaps if g > 0]
    assert statistics.mean(spaced) == pytest.approx(1 / 5.0, rel=0.1)


def test_popular_tenants_ask_more_with_skew() -> None:
    counts = [0] * 4
    for a in arrivals(Workload(tenants=4, requests=4000, skew=1.0)):
        counts[a.tenant] += 1
    # Weights 1, 1/2, 1/3, 1/4.
    assert counts[0] > counts[1] > counts[2] > counts[3]
    assert counts[0] / counts[3] == pytest.approx(4, rel=0.2)


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"tenants": 0}, "tenants must be at least 1"),
        ({"rate_per_s": 0}, "rate_per_s must be positive"),
        ({"burst": 100, "requests": 10}, "burst must be"),
        ({"burst_at": 2}, "burst_at"),
    ],
)
def test_bad_workloads_say_what_to_change(kw: dict[str, float], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        Workload(**kw)  # type: ignore[arg-type]


def test_summary_ratios_pair_each_rep() -> None:
    def run(policy: str, rep: int, computed: float, p90: float) -> dict[str, object]:
        return {
            "policy": policy,
            "rep": rep,
            "prefill_tokens_computed": computed,
            "hit_rate": 0.5,
            "ttft_p50_ms": p90 / 2,
            "ttft_p90_ms": p90,
            "index_blocks": 10,
            "tail": {"requests": 1, "in_burst": 1, "decode_target_ms": p90 / 3, "prefill_ms": 5},
        }

    runs = [
        run("round_robin", 0, 900, 400),
        run("approximate", 0, 1000, 300),
        run("precise", 0, 500, 150),
        run("round_robin", 1, 900, 400),
        run("approximate", 1, 800, 200),
        run("precise", 1, 600, 200),
    ]
    s = summarize(runs)
    ratio = s["precise_over_approximate"]["prefill_tokens_computed"]
    assert (ratio["min"], ratio["max"], ratio["n"]) == (0.5, 0.75, 2)
    assert s["precise_over_approximate"]["ttft_p90_ms"]["median"] == pytest.approx(0.75)
    assert s["policies"]["approximate"]["prefill_tokens_computed"]["median"] == 900
    assert s["policies"]["precise"]["tail_decode_target_ms"]["median"] == pytest.approx(175 / 3)


def test_the_tail_is_the_slowest_tenth_read_from_the_proxys_records() -> None:
    # 20 answers, 10..200 ms; the slowest tenth is the last two (190 and 200 ms), both of the
    # burst. An answer the proxy kept no record of counts, with no timings.
    answers = [Answer(0, (i + 1) / 100, 200, burst=i >= 17, transfer_id=f"t{i}") for i in range(20)]
    answers.append(Answer(0, 1.0, 500, transfer_id="failed"))  # not answered: not counted
    records = {
        f"t{i}": {"target_ms": 10.0 * i, "prefill_ms": None if i == 19 else 3.0 * i}
        for i in range(20)
        if i != 18
    }
    got = tail(answers, records)
    assert got == {
        "requests": 2,
        "in_burst": 2,
        "ttft_ms": pytest.approx(195.0),
        "decode_target_ms": 190.0,
        "prefill_ms": None,
    }
    records["t18"] = {"target_ms": 100.0, "prefill_ms": 40.0}
    got = tail(answers, records)
    assert got["decode_target_ms"] == 145.0 and got["prefill_ms"] == 40.0
