"""The index answers what vLLM's own cache map holds, block for block, per group."""

from __future__ import annotations

import random

from app.proxy.kv_events.index import GroupId, InstanceIndex
from app.proxy.kv_events.keys import KeyScheme
from app.proxy.kv_events.wire import BlockRemoved
from tests.proxy.kv_events.engine import CacheEngine, full_attention, prompt, sliding_window


def blocks(index: InstanceIndex, tokens: list[int], group: int = 0, **extra: str) -> int:
    hits = {h.group.group: h for h in index.lookup(index.scheme.prompt(tokens, **extra))}
    return hits[group].blocks if group in hits else 0


def test_lookup_equals_vllms_cache_through_evictions() -> None:
    rng = random.Random(7)
    engine = CacheEngine(num_blocks=24)  # small: later prompts evict earlier ones
    index = InstanceIndex(KeyScheme.new(16))
    heads = [prompt(48, s) for s in range(3)]
    served: list[list[int]] = []
    removed = 0
    for seq in range(60):
        tokens = rng.choice(heads)[: rng.randrange(0, 49)] + prompt(
            rng.randrange(8, 120), 100 + seq
        )
        engine.serve(tokens)
        batch = engine.take()
        removed += sum(len(e.block_hashes) for e in batch.events if isinstance(e, BlockRemoved))
        index.apply(seq, batch)
        served.append(tokens)
        for past in served:
            assert blocks(index, past) == engine.held(past), (seq, past[:3])
    assert removed > 50  # the pool evicted a lot, and the index followed
    assert index.consistent and index.status().unplaced == 0
    assert len(index) == sum(1 for _ in engine.manager.block_pool.cached_block_hash_to_block._cache)


def test_adapter_and_salt_are_part_of_the_prefix() -> None:
    engine = CacheEngine()
    index = InstanceIndex(KeyScheme.new(16))
    tokens = prompt(70, 1)
    engine.serve(tokens, salt="s", lora="a")
    index.apply(0, engine.take())
    assert blocks(index, tokens, lora_name="a", cache_salt="s") == 4
    assert blocks(index, tokens, lora_name="a") == 0
    assert blocks(index, tokens, cache_salt="s") == 0
    assert blocks(index, tokens) == 0
    # A longer prompt sharing the prefix chains from the stored blocks (parent hash).
    longer = [*tokens[:64], *prompt(40, 2)]
    engine.serve(longer, salt="s", lora="a")
    index.apply(1, engine.take())
    assert (
        blocks(index, longer, lora_name="a", cache_salt="s")
        == 6
        == engine.held(longer, salt="s", lora="a")
    )


def test_groups_are_answered_apart() -> None:
    # Full attention and a 32-token sliding window, as a hybrid model's two groups.
    engine = CacheEngine(num_blocks=40, groups=[full_attention(), sliding_window(32)])
    index = InstanceIndex(KeyScheme.new(16))
    a, b = prompt(100, 1), prompt(300, 2)
    engine.serve(a)
    index.apply(0, engine.take())
    engine.serve(b)  # evicts some of a's blocks, group by group
    index.apply(1, engine.take())
    for tokens in (a, b):
        hits = {h.group: h for h in index.lookup(index.scheme.prompt(tokens))}
        for g in (0, 1):
            assert hits[GroupId(g, "GPU")].blocks == engine.held(tokens, group=g)
    full, window = index.lookup(index.scheme.prompt(b))
    assert (full.kind, window.kind, window.sliding_window) == (
        "full_attention",
        "sliding_window",
        32,
    )
    assert full.tokens == 16 * full.blocks


def test_blocks_bigger_than_the_key_unit() -> None:
    engine = CacheEngine(groups=[full_attention(32)], hash_block_size=32)
    index = InstanceIndex(KeyScheme.new(16))
    tokens = prompt(100, 3)
    engine.serve(tokens)
    index.apply(0, engine.take())
    (hit,) = index.lookup(index.scheme.prompt(tokens))
    assert (hit.block_size, hit.blocks, hit.held) == (32, 3, (True, True, True))
    assert engine.held(tokens) == 3
