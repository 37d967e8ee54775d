"""Memory is bounded per instance: past ``max_blocks`` the index drops stores and says so."""

from __future__ import annotations

import pytest

from app.proxy.kv_events.index import InstanceIndex
from app.proxy.kv_events.keys import KeyScheme
from tests.proxy.kv_events.engine import CacheEngine, prompt


def test_over_the_bound_stores_are_dropped_and_the_index_says_so() -> None:
    engine = CacheEngine()
    index = InstanceIndex(KeyScheme.new(16), max_blocks=5)
    a, b = prompt(64, 1), prompt(64, 2)
    engine.serve(a)
    engine.serve(b)
    index.apply(0, engine.take())
    status = index.status()
    assert (status.blocks, status.unplaced, status.consistent) == (5, 3, False)
    assert status.reason == "over its bound of 5 blocks: stores past it are dropped"
    # What it kept is still true: all of a, the first block of b.
    hits = [index.lookup(index.scheme.prompt(p))[0].blocks for p in (a, b)]
    assert hits == [4, 1]
    # Removals still apply, and a clear makes it whole again.
    engine.reset()
    index.apply(1, engine.take())
    assert (len(index), index.consistent) == (0, True)
    with pytest.raises(ValueError, match="max_blocks >= 1; got 0"):
        InstanceIndex(KeyScheme.new(16), max_blocks=0)
