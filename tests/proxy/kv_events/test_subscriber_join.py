"""A subscriber that starts after the engine published rebuilds the index from the replay
socket, and is consistent at once if the engine's buffer still starts at seq 0."""

from __future__ import annotations

from app.proxy.kv_events import EngineEvents, KvEventFeed, SubscriberSettings
from tests.proxy.kv_events.engine import CacheEngine, Endpoints, prompt
from tests.proxy.kv_events.zmq_tools import until


async def test_joining_late_rebuilds_from_the_replay(engine: CacheEngine, ends: Endpoints) -> None:
    a, b = prompt(64, 1), prompt(96, 2)
    engine.serve(a)
    engine.publish()
    engine.serve(b)
    engine.publish()
    settings = SubscriberSettings(topic="kv", idle_check_s=60.0)
    async with KvEventFeed([EngineEvents("e", ends.sub, ends.replay)], settings) as feed:
        index = feed.index("e")
        await until("the replayed batches", lambda: index.last_seq == 1)
        hits = [feed.lookup(p)["e"].groups[0].blocks for p in (a, b)]
        assert hits == [4, 6] and index.consistent and feed.status()[0].replays == 1
