"""What the engines really hold: per-instance, per-group indexes fed by vLLM's KV cache events.

wire.py decodes what vLLM's ZMQ publisher sends, keys.py keys token prefixes the router can
compute, index.py keeps one engine's blocks per group, subscriber.py follows one engine over
ZMQ (with replay on gaps), feed.py runs them all and answers lookups, engine_hit.py turns one
engine's per-group answers into the hit its coordinator accepts.
"""

from app.proxy.kv_events.engine_hit import EngineHit, engine_hit
from app.proxy.kv_events.feed import EngineEvents, InstanceHits, KvEventFeed
from app.proxy.kv_events.index import GroupHit, GroupId, IndexStatus, InstanceIndex, Order
from app.proxy.kv_events.keys import KeyScheme, PromptKeys
from app.proxy.kv_events.subscriber import EngineSubscriber, SubscriberSettings, SubscriberStatus

__all__ = [
    "EngineEvents",
    "EngineHit",
    "EngineSubscriber",
    "GroupHit",
    "GroupId",
    "IndexStatus",
    "InstanceHits",
    "InstanceIndex",
    "KeyScheme",
    "KvEventFeed",
    "Order",
    "PromptKeys",
    "SubscriberSettings",
    "SubscriberStatus",
    "engine_hit",
]
