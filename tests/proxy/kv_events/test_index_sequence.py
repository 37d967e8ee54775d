"""Sequence numbers: the index is consistent only after every batch since a state it knew whole;
a gap or a restart clears it and says why, a fresh start or a clear makes it whole again."""

from __future__ import annotations

from vllm.distributed import kv_events as vllm_events

from app.proxy.kv_events.index import InstanceIndex, Order
from app.proxy.kv_events.keys import KeyScheme
from tests.proxy.kv_events.engine import CacheEngine, prompt, to_wire


def held(index: InstanceIndex, tokens: list[int]) -> int:
    hits = index.lookup(index.scheme.prompt(tokens))
    return hits[0].blocks if hits else 0


def cleared(ts: float) -> vllm_events.KVEventBatch:
    return vllm_events.KVEventBatch(ts=ts, events=[vllm_events.AllBlocksCleared()])


def test_order() -> None:
    index = InstanceIndex(KeyScheme.new(16))
    assert index.order(0, 1.0) is Order.NEXT
    assert index.order(3, 1.0) is Order.MISSING  # joined late
    index.apply(0, to_wire(cleared(10.0)))
    index.apply(1, to_wire(cleared(11.0)))
    assert index.order(2, 12.0) is Order.NEXT
    assert index.order(4, 12.0) is Order.MISSING  # a gap
    assert index.order(1, 11.0) is Order.DUPLICATE  # seen again (a replay, then live)
    assert index.order(0, 10.0) is Order.DUPLICATE
    assert index.order(1, 20.0) is Order.MISSING  # newer than seq 1: a restarted engine's
    assert index.order(0, 20.0) is Order.NEXT  # a restarted engine's first batch


def test_gap_clears_and_says_what_was_missed() -> None:
    engine = CacheEngine()
    index = InstanceIndex(KeyScheme.new(16))
    a, b = prompt(64, 1), prompt(64, 2)
    assert (index.consistent, index.reason) == (False, "no events yet")
    engine.serve(a)
    index.apply(0, engine.take())
    assert index.consistent and held(index, a) == 4
    engine.serve(b)
    engine.take()  # batch 1 never arrives
    engine.serve(prompt(32, 3))
    index.apply(2, engine.take())
    # Batch 1 could have removed a's blocks: forgotten, and the answers are a lower bound.
    assert (index.consistent, index.reason) == (False, "missed batches 1..1")
    assert held(index, a) == 0 and held(index, b) == 0 and held(index, prompt(32, 3)) == 2
    # A reset of the engine's prefix cache is a state known whole.
    engine.reset()
    index.apply(3, engine.take())
    assert (index.consistent, index.reason, len(index)) == (True, None, 0)


def test_late_join_and_restart_are_named() -> None:
    index = InstanceIndex(KeyScheme.new(16))
    index.apply(5, to_wire(cleared(1.0)))  # AllBlocksCleared: whole again at once
    assert index.consistent
    index.apply(6, to_wire(vllm_events.KVEventBatch(ts=2.0, events=[])))
    fresh = InstanceIndex(KeyScheme.new(16))
    fresh.apply(5, to_wire(vllm_events.KVEventBatch(ts=1.0, events=[])))
    assert fresh.reason == "first batch seen is seq 5: batches 0..4 were missed"
    index.apply(2, to_wire(vllm_events.KVEventBatch(ts=3.0, events=[])))
    assert index.reason == "seq went back from 6 to 2: the engine restarted"
    index.apply(0, to_wire(vllm_events.KVEventBatch(ts=4.0, events=[])))
    assert (index.consistent, index.last_seq) == (True, 0)  # a fresh engine holds nothing


def test_a_parent_the_index_does_not_hold_means_missed_events() -> None:
    engine = CacheEngine()
    index = InstanceIndex(KeyScheme.new(16))
    index.apply(0, to_wire(cleared(1.0)))
    engine.serve(prompt(64, 1))
    engine.take()  # applied nowhere: the index misses these stores
    engine.serve(prompt(64, 1) + prompt(32, 2))  # chains from the missed blocks
    index.apply(1, engine.take())
    status = index.status()
    assert not status.consistent and status.unplaced == 2
    assert status.reason is not None and "which the index does not hold" in status.reason


def test_an_undecodable_batch_is_lost_not_guessed() -> None:
    engine = CacheEngine()
    index = InstanceIndex(KeyScheme.new(16))
    engine.serve(prompt(64, 1))
    index.apply(0, engine.take())
    index.skip(1, 5.0, "unknown event type")
    assert index.reason == "batch 1 could not be applied: unknown event type"
    assert (len(index), index.last_seq, index.last_ts) == (0, 1, 5.0)
