"""An engine restarted on the same endpoints (a new publisher, seq from 0): the index forgets
the old engine and follows the new one, whether it publishes or not."""

from __future__ import annotations

import asyncio

from app.proxy.kv_events import EngineEvents, KvEventFeed, SubscriberSettings
from tests.proxy.kv_events.engine import (
    CacheEngine,
    Endpoints,
    prompt,
    publisher,
    wait_ports_free,
)
from tests.proxy.kv_events.zmq_tools import until

OLD, NEW = prompt(160, 1), prompt(64, 2)


def blocks(feed: KvEventFeed, tokens: list[int]) -> int:
    groups = feed.lookup(tokens)["e"].groups
    return groups[0].blocks if groups else 0


async def follow_old_engine(ends: Endpoints, feed: KvEventFeed) -> None:
    """Three batches of an engine, followed, then the engine gone."""
    old = CacheEngine(num_blocks=24, pub=publisher(ends))
    index = feed.index("e")
    await until("the subscriber to find the engine empty", lambda: index.consistent)
    await asyncio.sleep(0.3)
    for n in (64, 128, 160):
        old.serve(OLD[:n])
        old.publish()
    await until("the old engine's blocks", lambda: blocks(feed, OLD) == 10)
    assert index.last_seq == 2
    old.close()
    wait_ports_free(ends)


async def test_a_restarted_engine_replaces_the_old_one(ends: Endpoints) -> None:
    settings = SubscriberSettings(topic="kv", idle_check_s=60.0)  # only batches reveal it
    async with KvEventFeed([EngineEvents("e", ends.sub, ends.replay)], settings) as feed:
        await follow_old_engine(ends, feed)
        new = CacheEngine(num_blocks=24, pub=publisher(ends))
        try:
            await asyncio.sleep(0.5)  # the SUB socket reconnects (ZMQ drops what comes before)
            new.serve(NEW)
            new.publish()  # seq 0 again
            await until("the new engine's blocks", lambda: blocks(feed, NEW) == 4)
            assert blocks(feed, OLD) == 0
            index = feed.index("e").status()
            assert (index.consistent, index.last_seq, index.blocks) == (True, 0, 4)
        finally:
            new.close()


async def test_a_silent_restart_is_found_by_the_idle_check(ends: Endpoints) -> None:
    settings = SubscriberSettings(topic="kv", idle_check_s=0.3)
    async with KvEventFeed([EngineEvents("e", ends.sub, ends.replay)], settings) as feed:
        await follow_old_engine(ends, feed)
        new = CacheEngine(num_blocks=24, pub=publisher(ends))  # publishes nothing
        try:
            index = feed.index("e")
            # It asked the new engine from seq 0: nothing published, so nothing held.
            await until("the old engine forgotten", lambda: index.consistent and not len(index))
            assert index.last_seq is None
            assert feed.status()[0].replays >= 2  # on start, then idle checks
        finally:
            new.close()
