"""The pool's hit length against vLLM's own KV cache coordinator, on seeded random hit patterns.

vLLM's side is real: ``get_kv_cache_coordinator`` builds a ``UnitaryKVCacheCoordinator`` or
``HybridKVCacheCoordinator`` over a real ``BlockPool`` whose prefix cache holds a block for
every pooled (group, block) of the pattern, under the request's chained block hashes; the
request asks with ``num_tokens - 1`` as vLLM's ``KVCacheManager.get_computed_blocks`` does.

Hashes are computed at the gcd of the block sizes (vLLM's ``hash_block_size``); a group with
larger blocks is keyed by the hash of its last fine block (vLLM's
``BlockHashListWithBlockSize``). When block sizes differ and a Mamba group's blocks are larger
than the hash block, vLLM 0.32 would by default land hits between block boundaries ("partial
hash hits"); the pool stores whole blocks, so those configurations are compared with
``allow_partial_hash_hits=False``. With equal block sizes (the default for hybrid Mamba
models) vLLM's default is already off, which the test checks.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from functools import reduce
from typing import Any

import pytest

from app.store.coordinator import PoolCoordinator, PoolGroup

torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="the oracle is vLLM itself")

from vllm.v1.core.kv_cache_coordinator import get_kv_cache_coordinator  # noqa: E402
from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

CASES_PER_CONFIG = 80
MAX_TOKENS = 400
DTYPE = torch.bfloat16


def vllm_spec(g: PoolGroup) -> KVCacheSpec:
    common: dict[str, Any] = {"block_size": g.block_size, "num_kv_heads": 1, "dtype": DTYPE}
    if g.kind == "full_attention":
        return FullAttentionSpec(head_size=8, **common)
    if g.kind == "mla":
        return MLAAttentionSpec(head_size=8, **common)
    if g.kind == "sliding_window":
        assert g.sliding_window is not None
        return SlidingWindowSpec(head_size=8, sliding_window=g.sliding_window, **common)
    if g.kind == "chunked_local":
        assert g.attention_chunk_size is not None
        return ChunkedLocalAttentionSpec(
            head_size=8, attention_chunk_size=g.attention_chunk_size, **common
        )
    assert g.kind == "mamba"
    return MambaSpec(
        block_size=g.block_size, shapes=((4,),), dtypes=(DTYPE,), mamba_cache_mode="align"
    )


@dataclass(frozen=True)
class Config:
    """A model's groups as the pool sees them; ``eagle_groups``: the drafter's, if flagged."""

    groups: tuple[PoolGroup, ...]
    eagle_groups: tuple[int, ...] | None = None


class VllmOracle:
    """vLLM's coordinator for one configuration, with its prefix cache filled per case."""

    def __init__(self, config: Config, use_eagle: bool) -> None:
        groups = config.groups
        self.hash_block_size = reduce(math.gcd, (g.block_size for g in groups))
        self.block_sizes = [g.block_size for g in groups]
        flagged = set(config.eagle_groups or ())
        kv_cache_config = KVCacheConfig(
            num_blocks=64,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec([f"model.layers.{i}.attn"], vllm_spec(g), i in flagged)
                for i, g in enumerate(groups)
            ],
        )
        self.coordinator: Any = get_kv_cache_coordinator(
            kv_cache_config,
            max_model_len=4096,
            max_in_flight_tokens=4096,
            use_eagle=use_eagle,
            enable_caching=True,
            enable_kv_cache_events=False,
            dcp_world_size=1,
            pcp_world_size=1,
            scheduler_block_size=reduce(math.lcm, self.block_sizes),
            hash_block_size=self.hash_block_size,
            # Whole-block hits only (see the module docstring); a no-op when sizes are equal.
            allow_partial_hash_hits=False,
        )
        self.pool = self.coordinator.block_pool
        self._block = self.pool.blocks[1]
        self._next = 0

    def hit(self, masks: list[list[bool]], num_tokens: int) -> int:
        # Fresh hashes per case: earlier cases' blocks can never match.
        base = self._next
        num_hashes = num_tokens // self.hash_block_size
        self._next += num_hashes
        hashes = [BlockHash((base + i).to_bytes(8, "little")) for i in range(num_hashes)]
        for gid, (mask, bs) in enumerate(zip(masks, self.block_sizes, strict=True)):
            scale = bs // self.hash_block_size
            for i, pooled in enumerate(mask):
                if pooled:
                    key = make_block_hash_with_group_id(hashes[(i + 1) * scale - 1], gid)
                    self.pool.cached_block_hash_to_block.insert(key, self._block)
        _, hit_length, _ = self.coordinator.find_longest_cache_hit(hashes, num_tokens - 1)
        return int(hit_length)


def full(bs: int) -> PoolGroup:
    return PoolGroup("full_attention", bs)


def sliding(bs: int, window: int) -> PoolGroup:
    return PoolGroup("sliding_window", bs, sliding_window=window)


def mamba(bs: int) -> PoolGroup:
    return PoolGroup("mamba", bs)


CONFIGS = {
    "full": Config((full(16),)),
    "sliding alone": Config((sliding(16, 48),)),
    "mamba alone": Config((mamba(16),)),
    "full+full (one spec, two groups)": Config((full(16), full(16))),
    "full+sliding": Config((full(16), sliding(16, 33))),
    "full+sliding, wide window": Config((full(16), sliding(16, 129))),
    "full 16 + sliding 32": Config((full(16), sliding(32, 65))),
    "full 32 + sliding 16": Config((full(32), sliding(16, 40))),
    "full+mamba": Config((full(16), mamba(16))),
    "full 16 + mamba 64": Config((full(16), mamba(64))),
    "full 32 + mamba 64": Config((full(32), mamba(64))),
    # Mamba blocks smaller than the lcm: vLLM's hybrid allocator grows the attention block
    # until its page fits the Mamba state, so a Mamba hit must also be aligned to the lcm.
    "full 64 + mamba 16": Config((full(64), mamba(16))),
    "mamba 16 + full 48": Config((mamba(16), full(48))),
    "full 32 + mamba 48 (lcm 96)": Config((full(32), mamba(48))),
    "full 16 + sliding 64 + mamba 32": Config((full(16), sliding(64, 100), mamba(32))),
    "full+sliding+mamba": Config((full(16), sliding(16, 33), mamba(16))),
    "full 16 + sliding 16 + mamba 32": Config((full(16), sliding(16, 17), mamba(32))),
    "full 16 + sliding 32 + mamba 64": Config((full(16), sliding(32, 50), mamba(64))),
    "qwen3-next-like (3 mamba + full)": Config((mamba(16), mamba(16), mamba(16), full(16))),
    "mla+sliding": Config((PoolGroup("mla", 16), sliding(16, 33))),
    "full+chunked local": Config(
        (full(16), PoolGroup("chunked_local", 16, attention_chunk_size=64))
    ),
    "drafter flagged: full+sliding+mamba, eagle on full": Config(
        (full(16), sliding(16, 33), mamba(16)), eagle_groups=(0,)
    ),
    "drafter flagged: mamba+full, eagle on full": Config((mamba(16), full(16)), eagle_groups=(1,)),
}


def random_masks(rng: random.Random, groups: tuple[PoolGroup, ...], n: int) -> list[list[bool]]:
    """Per group, pooled blocks: dense, a pooled prefix, a prefix with holes, or sparse.

    Groups usually share the case's style (a pool's groups are stored together), sometimes not.
    """
    shared = rng.choice(["dense", "prefix", "holes", "sparse"])
    cut_frac = rng.random()
    masks: list[list[bool]] = []
    for g in groups:
        blocks = n // g.block_size
        style = shared if rng.random() < 0.7 else rng.choice(["dense", "prefix", "holes", "sparse"])
        if style == "dense":
            mask = [True] * blocks
        elif style == "prefix":
            cut = round(cut_frac * blocks) if rng.random() < 0.7 else rng.randint(0, blocks)
            mask = [i < cut for i in range(blocks)]
        elif style == "holes":
            p = rng.choice([0.6, 0.85, 0.95])
            mask = [rng.random() < p for _ in range(blocks)]
        else:
            mask = [rng.random() < 0.3 for _ in range(blocks)]
        masks.append(mask)
    return masks


def _cases() -> list[tuple[str, bool]]:
    """Every config with and without EAGLE, except the pairs that do not exist: vLLM (and the
    pool) refuse EAGLE with chunked local attention, and drafter-only EAGLE groups mean nothing
    without EAGLE."""
    out = []
    for name, config in CONFIGS.items():
        for eagle in (False, True):
            if eagle and any(g.kind == "chunked_local" for g in config.groups):
                continue
            if not eagle and config.eagle_groups is not None:
                continue
            out.append((name, eagle))
    return out


@pytest.mark.parametrize(("name", "use_eagle"), _cases())
def test_hit_length_matches_vllm(name: str, use_eagle: bool) -> None:
    config = CONFIGS[name]
    oracle = VllmOracle(config, use_eagle)
    ours = PoolCoordinator(config.groups, use_eagle=use_eagle, eagle_group_ids=config.eagle_groups)
    rng = random.Random(f"{name}/{use_eagle}")
    lcm = ours.lcm_block_size
    for case in range(CASES_PER_CONFIG):
        # Lengths around block boundaries matter most (the num_tokens - 1 cap, the look-ahead).
        n = rng.choice([rng.randint(1, MAX_TOKENS), lcm * rng.randint(1, MAX_TOKENS // lcm) + 1])
        if case % 5 == 0:
            n = lcm * rng.randint(1, MAX_TOKENS // lcm)
        masks = random_masks(rng, config.groups, n)
        want = oracle.hit(masks, n)
        got = ours.find_longest_cache_hit(masks, n).hit_tokens
        assert got == want, f"case {case}: num_tokens={n} masks={masks}"


def test_equal_block_sizes_use_whole_block_hits_by_default() -> None:
    # The pool's whole-block hits are vLLM's default when block sizes are equal, as they are
    # for hybrid Mamba models (vLLM sets the Mamba block size to the attention block size).
    groups = (full(16), mamba(16))
    kv_cache_config = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], vllm_spec(g)) for i, g in enumerate(groups)],
    )
    coordinator: Any = get_kv_cache_coordinator(
        kv_cache_config,
        max_model_len=4096,
        max_in_flight_tokens=4096,
        use_eagle=True,
        enable_caching=True,
        enable_kv_cache_events=False,
        dcp_world_size=1,
        pcp_world_size=1,
        scheduler_block_size=16,
        hash_block_size=16,
    )
    assert coordinator.enable_partial_hash_hits is False


def running_stores(
    c: PoolCoordinator, rng: random.Random, prompt: int, answer: int
) -> tuple[list[list[bool]], int]:
    """The pooled blocks a request leaves when stored as it runs (issue 54): the prompt in
    random chunks, then one token a step; each step stores the longest prefix whose needs
    are held (a window's blocks wholly before ``computed - window + 1`` freed, as vLLM does
    at the step's allocation; a Mamba state only at a chunk's end, until two steps later),
    skipping blocks ending at or before what the request stored. Returns the masks and the
    last boundary stored."""
    pooled = [[False] * ((prompt + answer) // g.block_size) for g in c.groups]
    ends, done = [], 0
    while done < prompt:
        done = min(prompt, done + rng.choice([c.lcm_block_size, 2 * c.lcm_block_size, 37]))
        ends.append(done)
    ends += range(prompt + 1, prompt + answer + 1)
    stored, before = 0, 0
    for i, end in enumerate(ends):
        held = []
        for g in c.groups:
            n = -(-end // g.block_size)
            if g.kind == "sliding_window":
                assert g.sliding_window is not None
                gone = max(0, before - g.sliding_window + 1) // g.block_size
                held.append([b >= gone for b in range(n)])
            elif g.kind == "mamba":
                recent = ends[max(0, i - 1) : i + 1]
                states = {e // g.block_size - 1 for e in recent if e % g.block_size == 0}
                held.append([b in states for b in range(n)])
            else:
                held.append([True] * n)
        upto = c.storable_tokens(end, held)
        if upto > stored:
            for gid, mask in enumerate(c.store_masks(upto, held)):
                first = stored // c.groups[gid].block_size
                for b, m in enumerate(mask):
                    if m and b >= first:
                        pooled[gid][b] = True
            stored = upto
        before = end
    return pooled, stored


@pytest.mark.parametrize(
    "name",
    ["full+sliding", "qwen3-next-like (3 mamba + full)", "full 16 + sliding 32 + mamba 64"],
)
def test_running_stores_hit_as_vllm_at_the_last_boundary_stored(name: str) -> None:
    """The next turn (the request's tokens and a new message) hits, in vLLM's coordinator as
    in the pool's, exactly at the last boundary the running stores reached."""
    config = CONFIGS[name]
    oracle = VllmOracle(config, False)
    ours = PoolCoordinator(config.groups)
    rng = random.Random(name)
    for case in range(20):
        prompt, answer = rng.randint(1, 200), rng.randint(1, 120)
        masks, stored = running_stores(ours, rng, prompt, answer)
        n = prompt + answer + rng.randint(1, 40)
        want = oracle.hit(masks, n)
        assert ours.find_longest_cache_hit(masks, n).hit_tokens == want, f"case {case}"
        assert want == stored, f"case {case}: prompt {prompt} answer {answer}"
