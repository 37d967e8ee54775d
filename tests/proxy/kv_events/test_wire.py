"""What vLLM's own encoder writes decodes here, field for field; what it does not, fails with
what was expected."""

from __future__ import annotations

import msgspec
import pytest
from vllm.distributed import kv_events as vllm_events

from app.errors import ProtocolError
from app.proxy.kv_events.wire import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    batch_ts,
    decode_batch,
    parse_published,
    parse_replayed,
    replay_request,
)


def vllm_batch() -> vllm_events.KVEventBatch:
    return vllm_events.KVEventBatch(
        ts=12.5,
        events=[
            vllm_events.BlockStored(
                block_hashes=[2**64 - 1, b"\x01" * 32],
                parent_block_hash=7,
                token_ids=[1, 2, 3, 4],
                block_size=2,
                lora_id=3,
                medium="GPU",
                lora_name="adapter",
                extra_keys=[("adapter", ("img", 0), "salt"), None],
                group_idx=1,
                kv_cache_spec_kind="sliding_window",
                kv_cache_spec_sliding_window=64,
            ),
            vllm_events.BlockRemoved(block_hashes=[5], medium="CPU", group_idx=2),
            vllm_events.AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )


def test_vllm_batch_decodes_field_for_field() -> None:
    batch = decode_batch(msgspec.msgpack.encode(vllm_batch()))
    assert batch.ts == 12.5 and batch.data_parallel_rank == 0
    stored, removed, cleared = batch.events
    assert stored == BlockStored(
        block_hashes=[2**64 - 1, b"\x01" * 32],
        parent_block_hash=7,
        token_ids=[1, 2, 3, 4],
        block_size=2,
        lora_id=3,
        medium="GPU",
        lora_name="adapter",
        extra_keys=[["adapter", ["img", 0], "salt"], None],
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=64,
    )
    assert removed == BlockRemoved(block_hashes=[5], medium="CPU", group_idx=2)
    assert cleared == AllBlocksCleared()


def test_fields_vllm_omits_default_and_unknown_ones_are_ignored() -> None:
    # An older publisher (no group_idx, no spec kind) and a newer one (a field added).
    payload = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockRemoved", "block_hashes": [1], "future": 1}], None, "extra"]
    )
    (event,) = decode_batch(payload).events
    assert event == BlockRemoved(block_hashes=[1])


def test_an_unknown_event_type_says_what_was_expected() -> None:
    payload = msgspec.msgpack.encode([3.5, [{"type": "BlockMoved", "block_hashes": [1]}]])
    with pytest.raises(ProtocolError, match=r"expected a vLLM KVEventBatch .*BlockMoved"):
        decode_batch(payload)
    assert batch_ts(payload) == 3.5  # what the subscriber still reads of it
    assert batch_ts(b"\xc1") is None


def test_frames_are_checked() -> None:
    assert parse_published([b"kv", (5).to_bytes(8, "big"), b"p"]) == (b"kv", 5, b"p")
    with pytest.raises(ProtocolError, match="expected 3 frames"):
        parse_published([b"kv", b"p"])
    with pytest.raises(ProtocolError, match="8-byte sequence number; got 4"):
        parse_published([b"kv", b"\x00" * 4, b"p"])
    end = [b"", b"", vllm_events.ZmqEventPublisher.END_SEQ, b""]
    assert parse_replayed(end)[1] == END_SEQ
    with pytest.raises(ProtocolError, match="expected 4 frames"):
        parse_replayed([b"x", b"", b"\x00" * 8, b""])


def test_replay_request_is_what_vllm_reads() -> None:
    # vLLM's _service_replay: ROUTER frames [client_id, b"", start_seq]; a DEALER's two frames
    # arrive after the id it adds.
    empty, start = replay_request(300)
    assert empty == b"" and int.from_bytes(start, "big") == 300
    with pytest.raises(ValueError, match="start seq >= 0; got -1"):
        replay_request(-1)
