"""``bench faults``: prompt lengths, the phase's requests, the fault names, the pool's counters."""

from __future__ import annotations

import pytest

from app.bench.faults.plan import (
    LENGTHS,
    MARGIN,
    FaultOptions,
    parse_faults,
    phase_requests,
    pool_counts,
    pool_note,
)
from app.bench.faults.plan import snap_prompt as snap
from app.errors import ConfigError
from app.harness.kv_watch import BLOCK


def _fits(n: int, out: int) -> bool:
    return MARGIN <= n % BLOCK <= BLOCK - out - MARGIN


def test_a_snapped_prompt_leaves_its_answer_in_its_last_block() -> None:
    for n in range(64, 1600, 7):
        got = snap(n, 32, lo=64)
        assert _fits(got, 32) and got <= n and n - got < BLOCK, (n, got)
    assert snap(300, 32) == 300  # 300 % 128 = 44: already fits
    assert snap(250, 32) == 128 + 88  # 122 in its block: down to the last that fits
    assert snap(130, 32) == 88  # 2 in its block: down into the block before
    assert snap(3, 8, lo=2) == MARGIN  # nothing fits below: up to the first that does


def test_too_many_output_tokens_for_a_block() -> None:
    with pytest.raises(ConfigError):
        snap(300, BLOCK - MARGIN)


def test_a_phase_is_seeded_and_its_repeats_name_an_earlier_prompt() -> None:
    a = phase_requests(2.0, 60, 7, LENGTHS, 0.25)
    assert a == phase_requests(2.0, 60, 7, LENGTHS, 0.25)
    assert a != phase_requests(2.0, 60, 8, LENGTHS, 0.25)
    repeats = [r for r in a if r.prompt != r.index]
    assert 0.1 < len(repeats) / len(a) < 0.4
    by_index = {r.index: r for r in a}
    for r in a:
        first = by_index[r.prompt]
        assert first.prompt == first.index and first.index <= r.index
        assert (r.prompt_tokens, r.max_tokens) == (first.prompt_tokens, first.max_tokens)
        assert _fits(r.prompt_tokens, r.max_tokens)
    # The arrivals are bench load's: the same times with or without repeats.
    assert [r.at_s for r in a] == [r.at_s for r in phase_requests(2.0, 60, 7, LENGTHS, 0.0)]


def test_fault_names() -> None:
    assert parse_faults("master, none,master") == ("master", "none")
    with pytest.raises(ConfigError):
        parse_faults("prefill")
    opts = FaultOptions(faults=("none", "master"))
    assert opts.horizon_s() == opts.pre_s + opts.after_s
    assert FaultOptions().horizon_s() == opts.pre_s + opts.engine_after_s


METRICS = """# HELP kvsidecar_pool_keys_total Pool keys by outcome.
kvsidecar_pool_keys_total{outcome="put"} 40.0
kvsidecar_pool_keys_total{outcome="failed"} 2.0
kvsidecar_pool_keys_total{outcome="timeout"} 1.0
kvsidecar_pool_keys_total{outcome="hit"} 5.0
kvsidecar_pool_bytes_total{direction="get"} 1024.0
kvsidecar_pool_saves_total 9.0
"""


def test_pool_counters_and_whether_the_pool_came_back() -> None:
    c = pool_counts(METRICS)
    assert c["keys.put"] == 40 and c["keys.timeout"] == 1 and c["bytes.get"] == 1024
    assert c["saves"] == 9
    more = {**c, "keys.put": 50.0, "keys.hit": 7.0}
    failing = {**c, "keys.failed": 12.0}
    snaps = {"kill": {"prefill": c}, "restarted": {"prefill": c}}
    assert "did not recover" not in (pool_note(snaps | {"end": {"prefill": more}}) or "")
    assert "10 stored" in (pool_note(snaps | {"end": {"prefill": more}}) or "")
    assert "did not recover" in (pool_note(snaps | {"end": {"prefill": failing}}) or "")
    # A restarted sidecar counts from 0 again: what it counted since is what it did.
    fresh = {"keys.put": 3.0}
    assert "3 stored" in (pool_note(snaps | {"end": {"prefill": fresh}}) or "")
    assert pool_note({"start": {}}) is None
