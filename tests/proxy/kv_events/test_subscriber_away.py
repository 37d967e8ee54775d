"""An engine that restarted while the subscriber's connection was down, and whose first batches
were lost with it: when the connection comes back, the subscriber checks with the replay socket
before it trusts the next batch, finds another engine, and drops the old engine's blocks.

Without that check the restart is invisible when the new engine's next batch happens to carry
the seq that follows the old engine's last (here 3 after 0..2): it reads as the next batch,
and the index keeps blocks the new engine never held."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from app.proxy.kv_events import EngineEvents, KvEventFeed, SubscriberSettings
from tests.proxy.kv_events.engine import (
    CacheEngine,
    Endpoints,
    prompt,
    publisher,
    wait_ports_free,
)
from tests.proxy.kv_events.zmq_tools import Link, until

OLD, NEW, LAST = prompt(160, 1), prompt(64, 2), prompt(48, 3)
# Only the mechanism under test may find the restart: no idle check within the test.
SETTINGS = SubscriberSettings(topic="kv", idle_check_s=60.0)


@contextlib.asynccontextmanager
async def _closing(engine: CacheEngine) -> AsyncIterator[None]:
    try:
        yield
    finally:
        engine.close()  # idempotent: closing it twice is harmless


def blocks(feed: KvEventFeed, tokens: list[int]) -> int:
    groups = feed.lookup(tokens)["e"].groups
    return groups[0].blocks if groups else 0


async def test_a_restart_behind_a_dropped_connection_drops_the_old_blocks(
    ends: Endpoints,
) -> None:
    old = CacheEngine(num_blocks=24, pub=publisher(ends))
    new: CacheEngine | None = None
    try:
        async with (
            Link(ends.sub) as link,
            KvEventFeed([EngineEvents("e", link.endpoint, ends.replay)], SETTINGS) as feed,
        ):
            index = feed.index("e")
            await until("the subscriber to find the engine empty", lambda: index.consistent)
            await asyncio.sleep(0.3)  # both SUB sockets join (ZMQ drops what comes before)
            for n in (64, 128, 160):
                old.serve(OLD[:n])
                old.publish()
            await until("the old engine's blocks", lambda: blocks(feed, OLD) == 10)
            assert index.last_seq == 2
            link.cut()
            old.close()
            wait_ports_free(ends)
            new = CacheEngine(num_blocks=24, pub=publisher(ends))
            await asyncio.sleep(0.5)  # the link's own SUB joins the new engine
            for n in (16, 32, 64):  # seq 0..2, lost with the connection
                new.serve(NEW[:n])
                new.publish()
            await link.restore()
            await asyncio.sleep(0.5)  # the subscriber reconnects
            new.serve(LAST)
            new.publish()  # seq 3: the old engine's last + 1
            await until("the new engine's blocks", lambda: blocks(feed, LAST) == 3)
            assert blocks(feed, OLD) == 0  # the old engine's, dropped
            assert blocks(feed, NEW) == new.held(NEW) == 4  # from the replay
            status = index.status()
            assert (status.consistent, status.last_seq, status.blocks) == (True, 3, 7)
            assert feed.status()[0].reconnects >= 1
    finally:
        old.close()  # idempotent: a test that failed early leaves it open
        if new is not None:
            new.close()


async def test_a_dropped_connection_to_the_same_engine_keeps_the_index(
    engine: CacheEngine, ends: Endpoints
) -> None:
    """No restart: the check finds the engine it followed, replays what the connection lost,
    and the index stays whole (the check costs a replay, not the index)."""
    async with (
        Link(ends.sub) as link,
        KvEventFeed([EngineEvents("e", link.endpoint, ends.replay)], SETTINGS) as feed,
    ):
        index = feed.index("e")
        await until("the subscriber to find the engine empty", lambda: index.consistent)
        await asyncio.sleep(0.3)
        engine.serve(OLD)
        engine.publish()
        await until("batch 0", lambda: index.last_seq == 0)
        link.cut()
        engine.serve(NEW)
        engine.publish()  # seq 1, lost with the connection
        await link.restore()
        await until("the reconnection", lambda: feed.status()[0].reconnects == 1)
        engine.serve(LAST)
        engine.publish()
        await until("batch 2", lambda: index.last_seq == 2)
        assert [blocks(feed, p) for p in (OLD, NEW, LAST)] == [10, 4, 3]
        assert index.consistent


async def test_without_a_replay_socket_a_reconnection_leaves_a_lower_bound(
    ends: Endpoints,
) -> None:
    old = CacheEngine(num_blocks=24, pub=publisher(ends))
    async with (
        Link(ends.sub) as link,
        KvEventFeed([EngineEvents("e", link.endpoint, None)], SETTINGS) as feed,
        _closing(old),
    ):
        index = feed.index("e")
        index.known_empty()  # as if it had started with the engine
        await asyncio.sleep(0.5)
        for n in (64, 128, 160):
            old.serve(OLD[:n])
            old.publish()
        await until("the old engine's blocks", lambda: blocks(feed, OLD) == 10)
        link.cut()
        old.close()
        wait_ports_free(ends)
        new = CacheEngine(num_blocks=24, pub=publisher(ends))
        try:
            await asyncio.sleep(0.5)
            for n in (16, 32, 64):  # seq 0..2, lost
                new.serve(NEW[:n])
                new.publish()
            await link.restore()
            await until("the reconnection", lambda: feed.status()[0].reconnects == 1)
            new.serve(LAST)
            new.publish()  # seq 3
            await until("batch 3", lambda: index.last_seq == 3)
            assert blocks(feed, OLD) == 0 and blocks(feed, LAST) == 3
            status = index.status()
            assert not status.consistent and status.reason is not None
            assert "no replay endpoint to check with" in status.reason
        finally:
            new.close()
