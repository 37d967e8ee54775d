"""Messages the subscriber cannot use: another topic is ignored, a malformed one is noted, a
batch that does not decode is lost (the index says so) rather than guessed at."""

from __future__ import annotations

import msgspec
import pytest
import zmq.asyncio
from vllm.distributed import kv_events as vllm_events

from app.proxy.kv_events import EngineSubscriber, InstanceIndex, KeyScheme, SubscriberSettings


def seq(n: int) -> bytes:
    return n.to_bytes(8, "big")


def batch(ts: float) -> bytes:
    return msgspec.msgpack.encode(
        vllm_events.KVEventBatch(ts=ts, events=[vllm_events.AllBlocksCleared()])
    )


async def test_unusable_messages() -> None:
    ctx = zmq.asyncio.Context()
    index = InstanceIndex(KeyScheme.new(16))
    sub = EngineSubscriber("e", "tcp://x:1", None, index, SubscriberSettings(topic="kv"), ctx)
    try:
        await sub._on_message([b"kv2", seq(0), batch(1.0)])  # SUBSCRIBE "kv" matches "kv2"
        assert index.batches == 0 and index.last_seq is None
        await sub._on_message([b"kv", seq(0), batch(1.0)])
        assert (index.batches, index.consistent) == (1, True)
        await sub._on_message([b"kv", b"\x00", batch(2.0)])
        assert sub.last_error == "from tcp://x:1: expected an 8-byte sequence number; got 1 bytes"
        unknown = msgspec.msgpack.encode([3.0, [{"type": "BlockMoved"}]])
        await sub._on_message([b"kv", seq(1), unknown])
        assert (index.last_seq, index.last_ts, index.consistent) == (1, 3.0, False)
        assert index.reason is not None and index.reason.startswith("batch 1 could not be applied")
        assert sub.status().last_batch_s_ago is not None
    finally:
        ctx.destroy(linger=0)


def test_settings_are_bounded() -> None:
    with pytest.raises(ValueError, match="rcvhwm and max_message_bytes >= 1"):
        SubscriberSettings(rcvhwm=0)
    with pytest.raises(ValueError, match="replay_timeout_s and idle_check_s > 0; got 0"):
        SubscriberSettings(replay_timeout_s=0)
