"""The feed answers per instance, under one key scheme, and reports each subscriber's state."""

from __future__ import annotations

import asyncio

import pytest

from app.proxy.kv_events import EngineEvents, KvEventFeed, SubscriberSettings
from tests.proxy.kv_events.engine import CacheEngine, Endpoints, prompt, publisher
from tests.proxy.kv_events.zmq_tools import until


async def test_each_instance_answers_for_itself(engine: CacheEngine, ends: Endpoints) -> None:
    other_ends = Endpoints.new()
    other = CacheEngine(num_blocks=24, pub=publisher(other_ends))
    engines = [
        EngineEvents("one", ends.sub, ends.replay),
        EngineEvents("two", other_ends.sub, other_ends.replay),
    ]
    a, b = prompt(64, 1), prompt(64, 1)[:32] + prompt(32, 2)
    try:
        async with KvEventFeed(engines, SubscriberSettings(topic="kv", idle_check_s=0.3)) as feed:
            await until("both consistent", lambda: all(s.index.consistent for s in feed.status()))
            await asyncio.sleep(0.2)
            engine.serve(a)
            engine.publish()
            other.serve(b)
            other.publish()

            def answer() -> dict[str, int]:
                return {n: h.groups[0].blocks for n, h in feed.lookup(a).items() if h.groups}

            await until("both engines' blocks", lambda: answer() == {"one": 4, "two": 2})
            hits = feed.lookup(a)
            assert hits["one"].consistent and hits["two"].groups[0].held == (
                True,
                True,
                False,
                False,
            )
            one, two = feed.status()
            assert (one.name, one.endpoint, two.replay_endpoint) == (
                "one",
                ends.sub,
                other_ends.replay,
            )
            assert (one.index.blocks, two.index.blocks) == (4, 4)
            assert one.last_batch_s_ago is not None
    finally:
        other.close()


async def test_a_subscriber_that_stops_says_why() -> None:
    feed = KvEventFeed([EngineEvents("e", "nonsense://x", None)])
    async with feed:
        await until("the subscriber to stop", lambda: feed.status()[0].last_error)
    status = feed.status()[0]
    assert not status.index.consistent
    assert status.index.reason is not None and "its subscriber stopped" in status.index.reason


def test_instance_names_are_distinct() -> None:
    with pytest.raises(ValueError, match="distinct engine names; got"):
        KvEventFeed([EngineEvents("e", "tcp://a:1"), EngineEvents("e", "tcp://b:1")])
