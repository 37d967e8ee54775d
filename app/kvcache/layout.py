"""Allocation of one rank's KV cache, its zero-copy per-layer views, pieces and regions.

Addresses are described once, as data, for the planner: the byte address of manager block ``b``,
kernel block ``k`` of a layer is ``base + b * block_stride + k * kernel_stride``; inside it each
*piece* (K, V, an MLA latent, a conv sub-projection, an ssm state) is ``outer`` repeats of
``unit_count`` TP units. Per-layer, cross-layer and heads-major layouts are all this one case.

The views handed to the engine (and to the oracle) are built separately with ``torch.as_strided``
from the logical shapes, so a planner bug does not hide behind a shared address formula.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from math import prod
from typing import TYPE_CHECKING

import msgspec

from app.errors import ConfigError
from app.kvcache.bounds import Index, NonNegInt, Positive
from app.kvcache.groups import NULL_BLOCK, CacheConfig, KVGroup
from app.kvcache.specs import (
    AttentionSpec,
    LayerSpec,
    MambaSpec,
    MLASpec,
    RegionKind,
    dtype_size,
    held_units,
    torch_dtype,
)

if TYPE_CHECKING:
    import torch


class LayoutMode(StrEnum):
    PER_LAYER = "per_layer"
    CROSS_LAYER = "cross_layer"


class KVLayout(StrEnum):
    """An attention kernel block's interior.

    ``HND``: K of every head (``[heads, tokens, head_size]``), then V. ``NHD``: the same with
    tokens outermost. ``HNC``: per head, per token one row of K's channels then V's (vLLM 0.32's
    ``[blocks, heads, tokens, K|V channels]`` view, its ``LBHNC`` layout).
    """

    HND = "HND"
    NHD = "NHD"
    HNC = "HNC"


# The values below travel in ``AgentMetadata`` as they are (msgspec Structs, frozen so they
# hash and compare by value). Pieces, placements and streams are many per rank: array_like
# keeps their field names off the wire.


class Piece(msgspec.Struct, frozen=True, array_like=True):
    """One TP-sharded stream of a layer inside a kernel block (offsets in bytes)."""

    name: str
    offset: NonNegInt
    outer: NonNegInt
    outer_stride: NonNegInt
    units: NonNegInt
    unit_first: NonNegInt
    unit_count: NonNegInt
    unit_stride: NonNegInt
    unit_bytes: NonNegInt

    @property
    def contiguous(self) -> bool:
        return self.unit_stride == self.unit_bytes


class LayerPlacement(msgspec.Struct, frozen=True, array_like=True):
    layer: Index
    group: Index
    base: NonNegInt
    block_stride: NonNegInt
    kernel_stride: NonNegInt
    ratio: Positive
    pieces: tuple[Piece, ...]
    buffer: Index  # index into RankLayout.buffers


class Stream(msgspec.Struct, frozen=True, array_like=True):
    offset: NonNegInt
    length: NonNegInt


class Region(msgspec.Struct, frozen=True):
    """A registered span as peers see it: one per (buffer, block stride, group)."""

    base: NonNegInt
    length: NonNegInt
    block_stride: NonNegInt
    kind: RegionKind
    group: Index
    layers: tuple[Index, ...]
    streams: tuple[Stream, ...]


def zeros_allocator(nbytes: int) -> torch.Tensor:
    import torch  # only where tensors are made: the proxy plans with this module

    return torch.zeros(nbytes, dtype=torch.uint8)


def strided(
    buf: torch.Tensor,
    dtype: torch.dtype,
    offset: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
) -> torch.Tensor:
    """A zero-copy view of ``buf`` (uint8) in ``dtype``; offset and strides in bytes."""
    size = dtype.itemsize
    if offset % size or any(s % size for s in strides):
        raise ConfigError(f"offset/strides not aligned to {dtype} elements")
    typed = buf.view(dtype)
    return typed.as_strided(shape, tuple(s // size for s in strides), offset // size)


@dataclass
class RankLayout:
    """The KV cache of one engine rank: buffers, per-layer views, placements and regions."""

    config: CacheConfig
    rank: int
    mode: LayoutMode
    kv_layout: KVLayout
    heads_major: bool
    buffers: list[torch.Tensor]
    placements: dict[int, LayerPlacement]
    views: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    stacked: bool = False  # per-layer tensors in one buffer (``allocate``)

    @property
    def tp(self) -> int:
        return self.config.tp

    @property
    def num_blocks(self) -> int:
        return self.config.num_blocks

    @property
    def null_block(self) -> int:
        return NULL_BLOCK

    def group(self, index: int) -> KVGroup:
        return self.config.groups[index]

    def spec(self, layer: int) -> LayerSpec:
        return self.config.model.layers[layer].spec

    def spans(self) -> list[tuple[int, int]]:
        """(address, length) of every buffer, for memory registration."""
        return [(b.data_ptr(), b.numel()) for b in self.buffers]

    def regions(self) -> list[Region]:
        """Regions deduplicated by (base, block stride, group): never by base alone, since
        several groups (and in cross-layer mode several layers) share one base."""
        out: dict[tuple[int, int, int], list[LayerPlacement]] = {}
        for p in self.placements.values():
            buf = self.buffers[p.buffer]
            out.setdefault((buf.data_ptr(), p.block_stride, p.group), []).append(p)
        regions = []
        for (base, stride, group), places in out.items():
            streams = sorted(
                {
                    Stream(pl.base - base + pc.offset, _piece_extent(pc))
                    for pl in places
                    for pc in pl.pieces
                },
                key=lambda s: s.offset,
            )
            regions.append(
                Region(
                    base=base,
                    length=self.buffers[places[0].buffer].numel(),
                    block_stride=stride,
                    kind=_region_kind(self.config.groups[group]),
                    group=group,
                    layers=tuple(sorted(pl.layer for pl in places)),
                    streams=tuple(streams),
                )
            )
        return sorted(regions, key=lambda r: (r.group, r.base))


def _region_kind(group: KVGroup) -> RegionKind:
    return group.layers[0].spec.region_kind


def _piece_extent(p: Piece) -> int:
    last = (p.outer - 1) * p.outer_stride + (p.unit_count - 1) * p.unit_stride + p.unit_bytes
    return last


def _attention_pieces(
    spec: AttentionSpec,
    tp: int,
    rank: int,
    kb: int,
    kv_layout: KVLayout,
    head_stride: int | None,
    v_offset: int,
) -> tuple[Piece, ...]:
    """K and V pieces of one kernel block. ``head_stride`` is set for the heads-major layout;
    ``v_offset`` is where V starts (in HNC: inside each token row)."""
    first, count = held_units(rank, tp, spec.num_kv_heads)
    size = dtype_size(spec.dtype)
    pieces = []
    row = (spec.head_size + spec.head_size_v) * size  # one token of one head in HNC
    for name, hs, base in (("k", spec.head_size, 0), ("v", spec.head_size_v, v_offset)):
        if kv_layout is KVLayout.HNC:
            pieces.append(
                Piece(
                    name,
                    base,
                    kb,
                    row,
                    spec.num_kv_heads,
                    first,
                    count,
                    kb * row,
                    hs * size,
                )
            )
        elif kv_layout is KVLayout.HND:
            unit = kb * hs * size
            stride = head_stride if head_stride is not None else unit
            pieces.append(Piece(name, base, 1, 0, spec.num_kv_heads, first, count, stride, unit))
        else:
            unit = hs * size
            pieces.append(
                Piece(
                    name,
                    base,
                    kb,
                    count * unit,
                    spec.num_kv_heads,
                    first,
                    count,
                    unit,
                    unit,
                )
            )
    return tuple(pieces)


def _state_pieces(spec: MambaSpec, tp: int, rank: int) -> tuple[Piece, ...]:
    pieces = []
    offset = 0
    for state in spec.states:
        size = dtype_size(state.dtype)
        if state.conv:
            width = state.width(tp)
            col = 0
            for part in state.parts:
                first, count = held_units(rank, tp, part.units)
                if spec.conv_layout == "SD":
                    unit = part.unit_elems * size
                    pieces.append(
                        Piece(
                            f"{state.name}.{part.name}",
                            offset + col * size,
                            state.rows,
                            width * size,
                            part.units,
                            first,
                            count,
                            unit,
                            unit,
                        )
                    )
                else:
                    unit = part.unit_elems * state.rows * size
                    pieces.append(
                        Piece(
                            f"{state.name}.{part.name}",
                            offset + col * state.rows * size,
                            1,
                            0,
                            part.units,
                            first,
                            count,
                            unit,
                            unit,
                        )
                    )
                col += count * part.unit_elems
        else:
            (part,) = state.parts
            first, count = held_units(rank, tp, part.units)
            unit = part.unit_elems * size
            pieces.append(Piece(state.name, offset, 1, 0, part.units, first, count, unit, unit))
        offset += state.nbytes(tp)
    return tuple(pieces)


def allocate(
    config: CacheConfig,
    rank: int,
    *,
    mode: LayoutMode = LayoutMode.PER_LAYER,
    kv_layout: KVLayout = KVLayout.HND,
    heads_major: bool = False,
    stacked: bool = False,
    allocator: Callable[[int], torch.Tensor] = zeros_allocator,
) -> RankLayout:
    """Allocate one rank's KV cache and describe it.

    ``stacked``: the per-layer tensors one after another in a single buffer, as vLLM 0.32
    allocates its layer-outermost (``LBHNC``) cache; the pages and strides are per-layer ones.
    """
    if heads_major and (mode is not LayoutMode.CROSS_LAYER or kv_layout is not KVLayout.HND):
        raise ConfigError("the heads-major variant needs --layout cross_layer and --kv-layout HND")
    if stacked and mode is not LayoutMode.PER_LAYER:
        raise ConfigError("the stacked variant needs --layout per_layer")
    tp, n = config.tp, config.num_blocks
    buffers: list[torch.Tensor] = []
    # slot -> (buffer index, slot offset in a block, block stride, slots in buffer, position)
    slot_home: dict[int, tuple[int, int, int, int, int]] = {}
    if stacked:
        buffers.append(allocator(n * sum(s.page_bytes for s in config.slots)))
        start = 0
        for s in config.slots:
            slot_home[s.index] = (0, start, s.page_bytes, 1, 0)
            start += n * s.page_bytes
    elif mode is LayoutMode.PER_LAYER:
        for s in config.slots:
            buffers.append(allocator(n * s.page_bytes))
            slot_home[s.index] = (len(buffers) - 1, 0, s.page_bytes, 1, 0)
    else:
        by_page: dict[int, list[int]] = {}
        for s in config.slots:
            by_page.setdefault(s.page_bytes, []).append(s.index)
        for page, slot_ids in by_page.items():
            stride = page * len(slot_ids)
            buffers.append(allocator(n * stride))
            for pos, sid in enumerate(slot_ids):
                slot_home[sid] = (len(buffers) - 1, pos * page, stride, len(slot_ids), pos)

    placements: dict[int, LayerPlacement] = {}
    views: dict[int, dict[str, torch.Tensor]] = {}
    for slot in config.slots:
        bi, slot_off, stride, nslots, pos = slot_home[slot.index]
        buf = buffers[bi]
        for gi, li in slot.members:
            group = config.groups[gi]
            spec = config.model.layers[li].spec
            kb, r = group.kernel_block_size, group.ratio
            if isinstance(spec, AttentionSpec):
                kpage = spec.page_bytes(tp, kb)
                hs = spec.heads_per_rank(tp)
                if heads_major:
                    size = dtype_size(spec.dtype)
                    bs = group.block_size
                    head_stride_k = nslots * bs * spec.head_size * size
                    v_off = hs * head_stride_k
                    if spec.head_size_v != spec.head_size:
                        raise ConfigError("heads-major needs equal K and V head sizes")
                    pieces = _attention_pieces(spec, tp, rank, kb, kv_layout, head_stride_k, v_off)
                    # The layer's K of head 0 starts ``pos`` blocks of one head in.
                    base = buf.data_ptr() + pos * bs * spec.head_size * size
                    kstride = kb * spec.head_size * size
                else:
                    size = dtype_size(spec.dtype)
                    # V follows K inside each token row (HNC), else after every head's K.
                    v_off = spec.head_size * size
                    if kv_layout is not KVLayout.HNC:
                        v_off *= hs * kb
                    pieces = _attention_pieces(spec, tp, rank, kb, kv_layout, None, v_off)
                    base, kstride = buf.data_ptr() + slot_off, kpage
            elif isinstance(spec, MLASpec):
                unit = spec.page_bytes(tp, kb)
                pieces = (Piece("latent", 0, 1, 0, 1, 0, 1, unit, unit),)
                base, kstride = buf.data_ptr() + slot_off, unit
            else:
                pieces = _state_pieces(spec, tp, rank)
                base, kstride = buf.data_ptr() + slot_off, 0
            placement = LayerPlacement(li, gi, base, stride, kstride, r, pieces, bi)
            placements[li] = placement
            views[li] = _views(buf, placement, spec, tp, kb, kv_layout, n)
    return RankLayout(
        config, rank, mode, kv_layout, heads_major, buffers, placements, views, stacked
    )


def _views(
    buf: torch.Tensor,
    pl: LayerPlacement,
    spec: LayerSpec,
    tp: int,
    kb: int,
    kv_layout: KVLayout,
    n: int,
) -> dict[str, torch.Tensor]:
    """Per-layer views with manager and kernel block axes first: ``[num_blocks, r, ...]``."""
    off0 = pl.base - buf.data_ptr()
    lead = (n, pl.ratio)
    lead_strides = (pl.block_stride, pl.kernel_stride)
    out: dict[str, torch.Tensor] = {}
    if isinstance(spec, AttentionSpec):
        dt = torch_dtype(spec.dtype)
        size = dt.itemsize
        for pc, hs in zip(pl.pieces, (spec.head_size, spec.head_size_v), strict=True):
            if kv_layout is KVLayout.HND:
                shape = (*lead, pc.unit_count, kb, hs)
                strides = (*lead_strides, pc.unit_stride, hs * size, size)
            elif kv_layout is KVLayout.HNC:
                # Token-major like NHD's, so token-indexed writers need no third case; the
                # strides are vLLM's (a token row holds K then V, a head holds kb rows).
                shape = (*lead, kb, pc.unit_count, hs)
                strides = (*lead_strides, pc.outer_stride, pc.unit_stride, size)
            else:
                shape = (*lead, kb, pc.unit_count, hs)
                strides = (*lead_strides, pc.outer_stride, hs * size, size)
            out[pc.name] = strided(buf, dt, off0 + pc.offset, shape, strides)
    elif isinstance(spec, MLASpec):
        row = spec.bytes_per_token(tp)
        out["latent"] = strided(
            buf, torch_dtype("uint8"), off0, (*lead, kb, row), (*lead_strides, row, 1)
        )
    else:
        offset = off0
        for state in spec.states:
            dt = torch_dtype(state.dtype)
            dims = state.shape(tp, spec.conv_layout)
            inner = [dt.itemsize * prod(dims[i + 1 :]) for i in range(len(dims))]
            out[state.name] = strided(buf, dt, offset, (n, *dims), (pl.block_stride, *inner))
            offset += state.nbytes(tp)
    return out
