"""vLLM's KV cache events as they come over ZMQ, decoded without vLLM.

vLLM (0.32, ``vllm/distributed/kv_events.py``) publishes one ``KVEventBatch`` per scheduler
step that changed the prefix cache. Its ``ZmqEventPublisher`` sends each batch as three frames
on a PUB socket: ``[topic, seq, payload]``, ``seq`` an 8-byte big-endian counter from 0 per
publisher (so per engine start), ``payload`` the batch in msgpack: an array
``[ts, events, data_parallel_rank]``, each event a map tagged by ``"type"`` (the class name).
Its ROUTER replay socket answers a request ``[b"", start_seq (8 bytes big-endian)]`` with every
batch it still buffers from ``start_seq`` on, each as ``[b"", topic, seq, payload]``, then
``[b"", b"", -1 (8 bytes, signed), b""]``.

The structs mirror vLLM's field for field so that what vLLM's own encoder writes decodes here;
fields vLLM may add later are ignored, and fields vLLM leaves out default to ``None``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from app.errors import ProtocolError

# vLLM's ExternalBlockHash: an int (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, its default: the
# low 64 bits of the block's hash) or the hash's bytes.
BlockHash = int | bytes

SEQ_BYTES = 8
END_SEQ = -1  # the replay's end marker, signed


class BlockStored(msgspec.Struct, tag="BlockStored", frozen=True):
    """Blocks the engine just made reusable (or, with a request's ``kv_cache_report_mode``
    ``full``, blocks it reused), in prefix order, chained from ``parent_block_hash``."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    # One entry per block of block_hashes, untagged: the LoRA name (if lora_name is set),
    # then (mm_identifier, offset) pairs, the cache salt (first block only), prompt-embeds
    # digests.
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    # The group's KVCacheSpecKind value ("full_attention", "sliding_window", "mamba", ...) and
    # window: vLLM's KVCacheManager.take_events stamps them on every BlockStored it publishes.
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", frozen=True):
    """Blocks the engine evicted from its prefix cache (one group's)."""

    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", frozen=True):
    """The engine reset its prefix cache: it holds no reusable block any more."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, frozen=True):
    """One scheduler step's events, in the order the engine made them."""

    ts: float  # the engine's time.time() when it published
    events: list[Event]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch from its msgpack payload (raises ``ProtocolError``)."""
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise ProtocolError(
            f"expected a vLLM KVEventBatch (msgpack [ts, events, dp_rank]); "
            f"got {len(payload)} bytes that do not decode: {e}"
        ) from e


_lenient = msgspec.msgpack.Decoder()


def batch_ts(payload: bytes) -> float | None:
    """A batch's ``ts`` when the rest of it does not decode (e.g. an event type this module
    does not know), else None."""
    try:
        raw = _lenient.decode(payload)
    except msgspec.DecodeError:
        return None
    if isinstance(raw, list) and raw and isinstance(raw[0], int | float):
        return float(raw[0])
    return None


def decode_seq(raw: bytes) -> int:
    """A sequence number frame (8 bytes, big-endian; -1 is the replay's end marker)."""
    if len(raw) != SEQ_BYTES:
        raise ProtocolError(f"expected an {SEQ_BYTES}-byte sequence number; got {len(raw)} bytes")
    return int.from_bytes(raw, "big", signed=True)


def parse_published(frames: list[bytes]) -> tuple[bytes, int, bytes]:
    """``(topic, seq, payload)`` of a PUB message (raises ``ProtocolError``)."""
    if len(frames) != 3:
        raise ProtocolError(f"expected 3 frames [topic, seq, payload]; got {len(frames)}")
    topic, seq, payload = frames
    return topic, decode_seq(seq), payload


def parse_replayed(frames: list[bytes]) -> tuple[bytes, int, bytes]:
    """``(topic, seq, payload)`` of a replay reply as a DEALER receives it; ``seq`` is
    ``END_SEQ`` on the end marker (raises ``ProtocolError``)."""
    if len(frames) != 4 or frames[0] != b"":
        raise ProtocolError(
            f"expected 4 frames [b'', topic, seq, payload] from the replay socket; "
            f"got {len(frames)} frames"
        )
    _, topic, seq, payload = frames
    return topic, decode_seq(seq), payload


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to ask for every buffered batch from ``start_seq`` on."""
    if start_seq < 0:
        raise ValueError(f"expected a replay start seq >= 0; got {start_seq}")
    return [b"", start_seq.to_bytes(SEQ_BYTES, "big")]
