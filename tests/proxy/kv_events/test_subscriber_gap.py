"""A batch lost on the way: the subscriber asks vLLM's replay socket for what it missed and
ends consistent; without a replay socket, or when the replay no longer has it, the index says
what was missed and keeps only what it knows to be true."""

from __future__ import annotations

import asyncio
import logging

import pytest

from app.proxy.kv_events import EngineEvents, KvEventFeed, SubscriberSettings
from tests.proxy.kv_events.engine import CacheEngine, Endpoints, prompt, publisher
from tests.proxy.kv_events.zmq_tools import relay, until

# No idle checks within a test: only the gap itself can start a replay.
GAP_ONLY = SubscriberSettings(topic="kv", idle_check_s=60.0)
A, B, C = prompt(64, 1), prompt(64, 2), prompt(64, 3)


def blocks(feed: KvEventFeed, tokens: list[int]) -> int:
    groups = feed.lookup(tokens)["e"].groups
    return groups[0].blocks if groups else 0


async def serve_three(engine: CacheEngine, feed: KvEventFeed) -> None:
    """Batch 0 (arrives), batch 1 (the relay drops it), batch 2 (reveals the gap)."""
    index = feed.index("e")
    await until("the subscriber to find the engine empty", lambda: index.consistent)
    await asyncio.sleep(0.3)  # both SUB sockets connect (ZMQ drops what comes before)
    engine.serve(A)
    engine.publish()
    await until("batch 0", lambda: index.last_seq == 0)
    engine.serve(B)
    engine.publish()
    engine.serve(C)
    engine.publish()
    await until("batch 2", lambda: index.last_seq == 2)


async def test_a_gap_is_filled_from_the_replay_socket(
    engine: CacheEngine, ends: Endpoints, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="app.proxy.kv_events")
    async with (
        relay(ends.sub, drop={1}) as lossy,
        KvEventFeed([EngineEvents("e", lossy, ends.replay)], GAP_ONLY) as feed,
    ):
        await serve_three(engine, feed)
        # Batch 2 is applied inside the replay, before its end marker: wait for the replay's
        # own end (its log line), or closing the feed can cut it off before it says so.
        replayed = "e: replayed 2 batch(es) from seq 0 (batch 2 came after batch 0)"
        await until("the replay's end", lambda: replayed in caplog.text)
        assert [blocks(feed, p) for p in (A, B, C)] == [4, 4, 4]
        status = feed.status()[0]
        assert status.index.consistent and status.index.batches == 3
        assert status.replays == 2  # on start, and on the gap


async def test_without_a_replay_socket_the_gap_is_reported(
    engine: CacheEngine, ends: Endpoints
) -> None:
    async with (
        relay(ends.sub, drop={1}) as lossy,
        KvEventFeed([EngineEvents("e", lossy, None)], GAP_ONLY) as feed,
    ):
        index = feed.index("e")
        index.known_empty()  # as if it had started with the engine
        await serve_three(engine, feed)
        # Batch 1 might have evicted A: forgotten; C, stored after the gap, is known.
        assert [blocks(feed, p) for p in (A, B, C)] == [0, 0, 4]
        status = feed.status()[0].index
        assert (status.consistent, status.reason) == (False, "missed batches 1..1")


async def test_a_replay_buffer_past_the_gap_leaves_a_lower_bound(ends: Endpoints) -> None:
    engine = CacheEngine(num_blocks=24, pub=publisher(ends, buffer_steps=1))
    try:
        async with (
            relay(ends.sub, drop={1}) as lossy,
            KvEventFeed([EngineEvents("e", lossy, ends.replay)], GAP_ONLY) as feed,
        ):
            await serve_three(engine, feed)
            assert [blocks(feed, p) for p in (A, B, C)] == [0, 0, 4]
            status = feed.status()[0].index
            assert not status.consistent and status.reason is not None
            assert "replay socket no longer has batch 0 as it was applied" in status.reason
    finally:
        engine.close()
