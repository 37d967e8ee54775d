"""Stores the index cannot key: block sizes off its unit, and sliding-window runs with skipped
blocks, which it places only from another group's keys."""

from __future__ import annotations

from vllm.distributed import kv_events as vllm_events

from app.proxy.kv_events.index import GroupId, InstanceIndex
from app.proxy.kv_events.keys import KeyScheme
from tests.proxy.kv_events.engine import CacheEngine, full_attention, prompt, to_wire


def stored(hashes: list[int], tokens: list[int], group: int) -> vllm_events.BlockStored:
    return vllm_events.BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=tokens,
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=group,
    )


def test_a_window_run_with_skipped_blocks_is_placed_from_another_group() -> None:
    index = InstanceIndex(KeyScheme.new(16))
    tokens = prompt(64, 1)
    # Group 0 stores four blocks; group 1 (a window) only the last two of the same run.
    batch = vllm_events.KVEventBatch(
        ts=1.0,
        events=[stored([11, 12, 13, 14], tokens, 0), stored([13, 14, 99], tokens, 1)],
    )
    index.apply(0, to_wire(batch))
    hits = {h.group: h for h in index.lookup(index.scheme.prompt(tokens))}
    assert hits[GroupId(0, "GPU")].held == (True, True, True, True)
    assert hits[GroupId(1, "GPU")].held == (False, False, True, True)
    assert hits[GroupId(1, "GPU")].blocks == 0  # no leading block: scoring a window is later
    assert index.status().unplaced == 1  # 99: no group keyed it
    assert index.consistent


def test_a_block_size_off_the_unit_is_refused_loudly() -> None:
    engine = CacheEngine(groups=[full_attention(24)], hash_block_size=24)
    index = InstanceIndex(KeyScheme.new(16))
    engine.serve(prompt(60, 1))
    index.apply(0, engine.take())
    status = index.status()
    assert (status.consistent, status.blocks, status.unplaced) == (False, 0, 2)
    assert status.reason is not None
    assert "block_size 24, not a multiple of the index's key unit of 16" in status.reason
