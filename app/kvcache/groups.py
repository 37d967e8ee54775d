"""KV cache groups, unified page sizes and block counts, after vLLM's hybrid allocator.

Follows vLLM 0.32 ``get_kv_cache_groups`` / ``get_kv_cache_config_from_groups`` exactly (checked
against vLLM itself in ``tests/kvcache/test_groups_vs_vllm.py``):

- Layers with equal specs are bucketed, buckets in order of their first layer. The group size is
  the smallest bucket, or the largest when that is less than 1.5 times the smallest (padding
  beats splitting). A bucket of ``n`` layers becomes ``cdiv(n, group_size)`` groups by stride:
  group ``i`` takes ``layers[i::num_groups]``, so a pipeline stage's share of a bucket stays
  balanced across its groups.
- Layer ``i`` of every group shares tensor (slot) ``i`` -- one block id means one page in every
  slot -- so there are as many slots as the largest group has layers.
- All-MLA models (DeepSeek-V3.2 latent + indexer) form one group whose layers keep their own
  page sizes, each in its own slot (vLLM's ``UniformTypeKVCacheSpecs``).
- With Mamba-style layers the block size is raised until one attention page holds the largest
  state page, and state pages are padded up to it (vLLM's ``Platform._align_hybrid_block_size``).
- An attention backend that takes any multiple of some size (``MultipleOf``, e.g. vLLM's CPU
  attention: 32) runs the whole manager block as one kernel block (vLLM's
  ``select_common_block_size``); by default the presets' fixed kernel blocks apply instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import ceil, lcm

from app.errors import ConfigError
from app.kvcache.presets import CacheLayer, ModelSpec
from app.kvcache.specs import AttentionSpec, LayerSpec, MambaSpec, MLASpec, SpecKind, validate_tp

NULL_BLOCK = 0


@dataclass(frozen=True)
class KVGroup:
    """Layers sharing one block table."""

    index: int
    kind: SpecKind
    layers: tuple[CacheLayer, ...]
    block_size: int
    kernel_block_size: int
    sliding_window: int | None = None

    @property
    def ratio(self) -> int:
        """Kernel blocks per manager block."""
        return self.block_size // self.kernel_block_size


@dataclass(frozen=True)
class Slot:
    """One per-layer tensor: ``num_blocks`` pages, shared by one layer of each member group."""

    index: int
    page_bytes: int
    members: tuple[tuple[int, int], ...]  # (group index, cache layer index)


@dataclass(frozen=True)
class CacheConfig:
    """The rank-independent part of a layout: groups, slots and sizes for one TP size."""

    model: ModelSpec
    tp: int
    block_size: int
    groups: tuple[KVGroup, ...]
    slots: tuple[Slot, ...]
    num_blocks: int

    @property
    def bytes_per_block(self) -> int:
        return sum(s.page_bytes for s in self.slots)

    def slot_of(self, layer: int) -> Slot:
        for s in self.slots:
            if any(li == layer for _, li in s.members):
                return s
        raise KeyError(layer)


def _min_kernel(model: ModelSpec, spec: LayerSpec, multiple_of: int | None) -> int | None:
    """The smallest kernel block a layer's backend takes; None for state (no tokens)."""
    if multiple_of is not None and isinstance(spec, AttentionSpec):
        return multiple_of
    return model.kernel_block_size(spec)


def _kernel(
    model: ModelSpec, spec: LayerSpec, block_size: int, multiple_of: int | None = None
) -> int:
    """The kernel block a group runs: a ``MultipleOf`` backend takes the manager block whole."""
    if multiple_of is not None and isinstance(spec, AttentionSpec):
        return block_size
    k = model.kernel_block_size(spec)
    return block_size if k is None else k


def _check_block_size(model: ModelSpec, block_size: int, multiple_of: int | None) -> None:
    if block_size < 1:
        raise ConfigError(f"block size must be positive, not {block_size}")
    for layer in model.layers:
        k = _min_kernel(model, layer.spec, multiple_of)
        if k is not None and block_size % k:
            what = "MLA" if isinstance(layer.spec, MLASpec) else "attention"
            raise ConfigError(
                f"block size {block_size} is not a multiple of the {what} kernel block size {k}; "
                f"use --block-size {k * max(1, ceil(block_size / k))} or another multiple of {k}"
            )


def hybrid_block_size(
    model: ModelSpec, tp: int, block_size: int, *, kernel_multiple_of: int | None = None
) -> int:
    """Raise the block size so one attention page holds the largest state page.

    vLLM's ``Platform._align_hybrid_block_size``: the smallest multiple of
    ``max(block size, smallest kernel block)`` (at least 128 with MLA, for the MLA decode
    kernels) whose attention page covers the state page, rounded up to every kernel's smallest
    block.
    """
    states = [c.spec for c in model.layers if isinstance(c.spec, MambaSpec)]
    attn = [c.spec for c in model.layers if not isinstance(c.spec, MambaSpec)]
    if not states or not attn:
        return block_size
    per_token = {s.bytes_per_token(tp) for s in attn}
    if len(per_token) > 1:
        raise ConfigError(
            "a hybrid with attention layers of different token sizes is not supported"
        )
    attn_1tok = per_token.pop()
    kernels = [k for s in attn if (k := _min_kernel(model, s, kernel_multiple_of)) is not None]
    align = max([block_size, *kernels])
    if any(isinstance(s, MLASpec) for s in attn):
        align = max(align, 128)
    state_page = max(s.state_bytes(tp) for s in states)
    raised = align * ceil(state_page / (align * attn_1tok))
    every_kernel = lcm(*kernels)
    raised = every_kernel * ceil(raised / every_kernel)
    return max(block_size, raised)


def _bucket(model: ModelSpec) -> list[list[CacheLayer]]:
    """Layers by spec, buckets in order of their first layer (vLLM's registration order)."""
    buckets: dict[LayerSpec, list[CacheLayer]] = {}
    for layer in model.layers:
        buckets.setdefault(layer.spec, []).append(layer)
    return list(buckets.values())


def _groups_per_bucket(sizes: Sequence[int]) -> list[int]:
    """How many groups vLLM cuts each bucket of ``sizes[b]`` layers into.

    The group size is the smallest bucket, or the largest when that is below 1.5 times the
    smallest: vLLM pads a few layers rather than doubling the groups (gpt-oss + EAGLE:
    12 sliding + 13 full gives two groups of 13, not 12 + 12 + 1).
    """
    group_size = min(sizes)
    if max(sizes) < group_size * 1.5:
        group_size = max(sizes)
    return [-(-n // group_size) for n in sizes]


def build_cache_config(
    model: ModelSpec,
    tp: int,
    block_size: int,
    *,
    memory_bytes: int | None = None,
    num_blocks: int | None = None,
    kernel_multiple_of: int | None = None,
    mamba_block_size: int | None = None,
) -> CacheConfig:
    """Groups, slots and ``num_blocks`` (from a memory budget, or given) for one TP size.

    ``kernel_multiple_of``: the attention backend takes any multiple of this many tokens (vLLM's
    CPU attention: 32), so its kernel block is the manager block. ``mamba_block_size``: the state
    groups' block size when it is not the attention one (vLLM's ``mamba_cache_mode`` ``none``
    gives them ``max_model_len``); a state page is one block either way.
    """
    if tp < 1:
        raise ConfigError(f"TP size must be positive, not {tp}")
    for layer in model.layers:
        validate_tp(layer.spec, tp)
    _check_block_size(model, block_size, kernel_multiple_of)
    bs = hybrid_block_size(model, tp, block_size, kernel_multiple_of=kernel_multiple_of)

    groups: list[KVGroup] = []
    slots: list[Slot] = []
    if all(isinstance(c.spec, MLASpec) for c in model.layers):
        kernels = {_kernel(model, c.spec, bs) for c in model.layers}
        groups.append(KVGroup(0, SpecKind.MLA, model.layers, bs, max(kernels)))
        slots = [
            Slot(i, c.spec.page_bytes(tp, bs), ((0, c.index),)) for i, c in enumerate(model.layers)
        ]
    else:
        buckets = _bucket(model)
        page = max(c.spec.page_bytes(tp, bs) for c in model.layers)
        counts = _groups_per_bucket([len(b) for b in buckets])
        for layers, num_groups in zip(buckets, counts, strict=True):
            spec = layers[0].spec
            if not isinstance(spec, MambaSpec) and spec.page_bytes(tp, bs) != page:
                raise ConfigError(
                    f"layers {layers[0].name}.. have {spec.page_bytes(tp, bs)}-byte pages and "
                    f"others {page}; vLLM cannot share tensors between them"
                )
            window = spec.sliding_window if isinstance(spec, AttentionSpec) else None
            gbs = bs
            if isinstance(spec, MambaSpec) and mamba_block_size is not None:
                gbs = mamba_block_size
            kernel = _kernel(model, spec, gbs, kernel_multiple_of)
            for i in range(num_groups):
                # By stride, as vLLM: layers[i::n], not contiguous chunks.
                members = tuple(layers[i::num_groups])
                groups.append(KVGroup(len(groups), spec.kind, members, gbs, kernel, window))
        # vLLM's block holds the largest group's pages: one slot per layer position.
        width = max(len(g.layers) for g in groups)
        slots = [
            Slot(i, page, tuple((g.index, g.layers[i].index) for g in groups if i < len(g.layers)))
            for i in range(width)
        ]

    per_block = sum(s.page_bytes for s in slots)
    if num_blocks is None:
        if memory_bytes is None:
            raise ConfigError("give a memory budget or a block count")
        num_blocks = memory_bytes // per_block
    if num_blocks < 2:
        raise ConfigError(
            f"the memory budget holds {num_blocks} block(s) of {per_block} bytes; "
            f"give at least {2 * per_block} bytes (the null block plus one)"
        )
    return CacheConfig(model, tp, bs, tuple(groups), tuple(slots), num_blocks)


def blocks_for_tokens(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def group_rows(groups: Sequence[KVGroup]) -> list[tuple[KVGroup, LayerSpec, tuple[int, ...]]]:
    """Per group, one row per distinct spec (an MLA group with its indexer gives two)."""
    rows: list[tuple[KVGroup, LayerSpec, tuple[int, ...]]] = []
    for g in groups:
        by_spec: dict[LayerSpec, list[int]] = {}
        for c in g.layers:
            by_spec.setdefault(c.spec, []).append(c.index)
        rows.extend((g, spec, tuple(ix)) for spec, ix in by_spec.items())
    return rows
