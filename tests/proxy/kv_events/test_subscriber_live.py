"""Over real ZMQ from vLLM's publisher: stored chains, evictions and a reset reach the index,
which then answers what vLLM's own cache map holds."""

from __future__ import annotations

import asyncio

from app.proxy.kv_events import EngineEvents, KvEventFeed, SubscriberSettings
from tests.proxy.kv_events.engine import CacheEngine, Endpoints, prompt
from tests.proxy.kv_events.zmq_tools import until

# No idle checks within the test: what it sees came live over the SUB socket.
LIVE = SubscriberSettings(topic="kv", idle_check_s=60.0)


async def test_stores_evictions_and_a_reset_reach_the_index(
    engine: CacheEngine, ends: Endpoints
) -> None:
    async with KvEventFeed([EngineEvents("e", ends.sub, ends.replay)], LIVE) as feed:
        index = feed.index("e")
        await until("the subscriber to find the engine empty", lambda: index.consistent)
        await asyncio.sleep(0.2)  # the SUB socket connects (ZMQ drops what comes before)
        a, a2, b = prompt(100, 1), prompt(100, 1)[:64] + prompt(50, 2), prompt(300, 3)

        def answers() -> list[int]:
            hits = feed.lookup(a)["e"], feed.lookup(a2)["e"], feed.lookup(b)["e"]
            return [h.groups[0].blocks if h.groups else 0 for h in hits]

        engine.serve(a)
        engine.publish()
        engine.serve(a2)  # chains from a's fourth block
        engine.publish()
        await until("both prompts", lambda: answers() == [6, 7, 0])
        engine.serve(b)  # 18 blocks: evicts some of a and a2 from the 23 usable blocks
        assert engine.publish()
        truth = [engine.held(p) for p in (a, a2, b)]
        assert truth[2] == 18 and truth[0] < 6
        await until("the evictions", lambda: answers() == truth)
        engine.reset()
        engine.publish()
        await until("the reset", lambda: len(index) == 0)
        status = feed.status()[0]
        assert status.index.consistent and status.index.last_seq == 3
        assert status.replays >= 1 and status.replay_failures == 0
