"""A rank's layout built from what its engine registered (DESIGN §2a), not from a preset.

Every address comes from the engine's own tensor geometry: the byte offset of a layer's view,
the stride of its block axis, the strides of its head and token axes. The result is the same
``LayoutDesc`` the planner and the validation gate read for preset layouts, so the transfer path
has one case.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from app.errors import ConfigError
from app.kvcache.desc import GroupDesc, LayoutDesc
from app.kvcache.engine_spec import Axis, EngineGroup, EngineLayer, EngineRegistration
from app.kvcache.layout import LayerPlacement, Piece, Region, Stream
from app.kvcache.specs import RegionKind, SpecKind, dtype_size, held_units

_KINDS = {
    "full": SpecKind.FULL,
    "sliding": SpecKind.SLIDING,
    "mla": SpecKind.MLA,
    "mamba": SpecKind.MAMBA,
}
_REGION_KIND = {
    SpecKind.FULL: RegionKind.SPLIT,
    SpecKind.SLIDING: RegionKind.SPLIT,
    SpecKind.MLA: RegionKind.REPLICATE,
    SpecKind.MAMBA: RegionKind.STATE,
}


def engine_compat_hash(reg: EngineRegistration) -> str:
    """Model identity over the layer facts both sides must share; TP, block sizes and memory
    layout are left out (they are mapped at run time)."""
    kinds = {name: g.kind for g in reg.groups for name in g.layers}
    windows = {name: g.sliding_window for g in reg.groups for name in g.layers}
    facts = []
    for layer in reg.layers:
        channel = next((a.size for a in layer.axes if a.role == "channel"), 0)
        facts.append(
            [
                layer.name,
                kinds.get(layer.name),
                windows.get(layer.name),
                layer.dtype,
                layer.total_heads,
                layer.head_size,
                layer.head_size_v,
                channel if kinds.get(layer.name) == "mla" else 0,
                [
                    [s.name, s.dtype, s.conv, [[p.name, p.units, p.unit_elems] for p in s.parts]]
                    for s in layer.states
                ],
            ]
        )
    body = json.dumps([reg.model, facts])
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def _axis(layer: EngineLayer, role: str, required: bool = True) -> Axis | None:
    found = [a for a in layer.axes if a.role == role]
    if len(found) > 1:
        raise ConfigError(f"layer {layer.name}: two axes claim the role {role!r}")
    if not found and required:
        roles = [a.role for a in layer.axes]
        raise ConfigError(f"layer {layer.name}: no {role!r} axis among {roles}")
    return found[0] if found else None


def _attention_pieces(layer: EngineLayer, rank: int, tp: int) -> tuple[Piece, ...]:
    size = dtype_size(layer.dtype)
    head, token, channel = (_axis(layer, r) for r in ("head", "token", "channel"))
    kv = _axis(layer, "kv", required=False)
    assert head is not None and token is not None and channel is not None
    if channel.stride != 1:
        raise ConfigError(
            f"layer {layer.name}: channels are not contiguous (stride {channel.stride})"
        )
    first, count = held_units(rank, tp, layer.total_heads)
    if count != head.size:
        raise ConfigError(
            f"layer {layer.name}: the tensor holds {head.size} KV heads, TP {tp} of "
            f"{layer.total_heads} heads gives {count}"
        )
    want = layer.head_size if kv else layer.head_size + layer.head_size_v
    if channel.size != want:
        raise ConfigError(f"layer {layer.name}: channel axis has {channel.size}, expected {want}")
    pieces = []
    v_offset = kv.stride * size if kv else layer.head_size * size
    for name, width, offset in (("k", layer.head_size, 0), ("v", layer.head_size_v, v_offset)):
        # A head's tokens are one run (the unit is the whole head) only when the head axis
        # steps over all of them; with one head per rank NHD's token stride equals the width
        # too, but its heads sit inside each token row.
        if token.stride == width and head.stride >= token.size * width:
            outer, outer_stride, unit = 1, 0, token.size * width * size
        else:
            outer, outer_stride, unit = token.size, token.stride * size, width * size
        pieces.append(
            Piece(
                name,
                offset,
                outer,
                outer_stride,
                layer.total_heads,
                first,
                count,
                head.stride * size,
                unit,
            )
        )
    return tuple(pieces)


def _mla_pieces(layer: EngineLayer) -> tuple[Piece, ...]:
    size = dtype_size(layer.dtype)
    token, channel = _axis(layer, "token"), _axis(layer, "channel")
    assert token is not None and channel is not None
    if channel.stride != 1 or token.stride != channel.size:
        raise ConfigError(f"layer {layer.name}: the MLA latent rows are not contiguous")
    unit = token.size * channel.size * size
    return (Piece("latent", 0, 1, 0, 1, 0, 1, unit, unit),)


def _state_pieces(layer: EngineLayer, rank: int, tp: int) -> tuple[Piece, ...]:
    pieces = []
    for st in layer.states:
        size = dtype_size(st.dtype)
        if st.conv:
            rows, dim = (st.shape[1], st.shape[0]) if st.dim_first else (st.shape[0], st.shape[1])
            col = 0
            for part in st.parts:
                first, count = held_units(rank, tp, part.units)
                unit = part.unit_elems * size
                if st.dim_first:  # each column is ``rows`` contiguous elements
                    piece = Piece(
                        f"{st.name}.{part.name}",
                        st.offset + col * rows * size,
                        1,
                        0,
                        part.units,
                        first,
                        count,
                        unit * rows,
                        unit * rows,
                    )
                else:  # columns are contiguous inside each row
                    piece = Piece(
                        f"{st.name}.{part.name}",
                        st.offset + col * size,
                        rows,
                        dim * size,
                        part.units,
                        first,
                        count,
                        unit,
                        unit,
                    )
                pieces.append(piece)
                col += count * part.unit_elems
            if col != dim:
                raise ConfigError(
                    f"layer {layer.name} {st.name}: sub-projections cover {col} of {dim} columns"
                )
        else:
            (part,) = st.parts
            first, count = held_units(rank, tp, part.units)
            if count != st.shape[0]:
                raise ConfigError(
                    f"layer {layer.name} {st.name}: holds {st.shape[0]} units, TP {tp} of "
                    f"{part.units} gives {count}"
                )
            unit = part.unit_elems * size
            pieces.append(Piece(st.name, st.offset, 1, 0, part.units, first, count, unit, unit))
    return tuple(pieces)


def _placement(
    layer: EngineLayer, index: int, group: EngineGroup, base: int, rank: int, tp: int
) -> LayerPlacement:
    kind = _KINDS[group.kind]
    ratio = group.block_size // group.kernel_block_size
    if kind is SpecKind.MAMBA:
        if layer.block_stride <= 0:
            raise ConfigError(f"layer {layer.name}: a state layer needs its page stride")
        pieces = _state_pieces(layer, rank, tp)
        return LayerPlacement(index, -1, base, layer.block_stride, 0, 1, pieces, layer.buffer)
    block = _axis(layer, "block")
    kernel = _axis(layer, "kernel", required=False)
    assert block is not None
    size = dtype_size(layer.dtype)
    if kernel is None:  # vLLM's: one axis of kernel blocks, ``ratio`` of them per block
        kstride = block.stride * size
        bstride = ratio * kstride
    else:  # a block that is not ``ratio`` adjacent kernel blocks (e.g. cross-layer pages)
        if kernel.size != ratio:
            raise ConfigError(
                f"layer {layer.name}: kernel axis of {kernel.size}, the group has {ratio} "
                "kernel blocks per block"
            )
        kstride, bstride = kernel.stride * size, block.stride * size
    pieces = _mla_pieces(layer) if kind is SpecKind.MLA else _attention_pieces(layer, rank, tp)
    return LayerPlacement(index, -1, base, bstride, kstride, ratio, pieces, layer.buffer)


def _extent(p: Piece) -> int:
    return (p.outer - 1) * p.outer_stride + (p.unit_count - 1) * p.unit_stride + p.unit_bytes


def describe_engine(reg: EngineRegistration, bases: Sequence[int]) -> LayoutDesc:
    """The peer-facing layout of one engine rank; ``bases[i]`` is where the sidecar mapped
    ``reg.memory[i]``'s data."""
    if len(bases) != len(reg.memory):
        raise ConfigError(f"{len(reg.memory)} memory spans registered, {len(bases)} mapped")
    tp, rank = reg.tp_size, reg.rank
    if not 0 <= rank < tp:
        raise ConfigError(f"rank {rank} is outside TP size {tp}")
    index = {layer.name: i for i, layer in enumerate(reg.layers)}
    groups = []
    for gi, g in enumerate(reg.groups):
        if g.kind not in _KINDS:
            raise ConfigError(
                f"group {gi}: unknown kind {g.kind!r}; expected one of {sorted(_KINDS)}"
            )
        if g.block_size % g.kernel_block_size:
            raise ConfigError(
                f"group {gi}: block size {g.block_size} is not a multiple of the kernel block "
                f"size {g.kernel_block_size}"
            )
        missing = [n for n in g.layers if n not in index]
        if missing:
            raise ConfigError(f"group {gi} names layers without a tensor: {missing[:4]}")
        groups.append(
            GroupDesc(
                gi,
                _KINDS[g.kind],
                g.block_size,
                g.kernel_block_size,
                tuple(sorted(index[n] for n in g.layers)),
                g.sliding_window,
            )
        )
    placements = []
    regions: dict[tuple[int, int, int], list[LayerPlacement]] = {}
    for i, layer in enumerate(reg.layers):
        if not 0 <= layer.group < len(reg.groups):
            raise ConfigError(f"layer {layer.name}: group {layer.group} does not exist")
        if not 0 <= layer.buffer < len(reg.memory):
            raise ConfigError(f"layer {layer.name}: buffer {layer.buffer} does not exist")
        group = reg.groups[layer.group]
        pl = _placement(layer, i, group, bases[layer.buffer] + layer.offset, rank, tp)
        pl = LayerPlacement(
            pl.layer,
            layer.group,
            pl.base,
            pl.block_stride,
            pl.kernel_stride,
            pl.ratio,
            pl.pieces,
            pl.buffer,
        )
        span = reg.memory[layer.buffer]
        end = (
            layer.offset
            + (reg.num_blocks - 1) * pl.block_stride
            + max((pc.offset + _extent(pc) for pc in pl.pieces), default=0)
            + (pl.ratio - 1) * pl.kernel_stride
        )
        if layer.offset < 0 or end > span.size:
            raise ConfigError(
                f"layer {layer.name}: {reg.num_blocks} blocks reach byte {end} of a "
                f"{span.size}-byte buffer; the registration does not match the memory"
            )
        placements.append(pl)
        regions.setdefault((layer.buffer, pl.block_stride, layer.group), []).append(pl)
    out = []
    for (buf, stride, gi), places in regions.items():
        base = bases[buf]
        streams = sorted(
            {Stream(p.base - base + pc.offset, _extent(pc)) for p in places for pc in p.pieces},
            key=lambda s: s.offset,
        )
        out.append(
            Region(
                base,
                reg.memory[buf].size,
                stride,
                _REGION_KIND[groups[gi].kind],
                gi,
                tuple(sorted(p.layer for p in places)),
                tuple(streams),
            )
        )
    return LayoutDesc(
        compat_hash=engine_compat_hash(reg),
        tp=tp,
        rank=rank,
        num_blocks=reg.num_blocks,
        null_block=reg.null_block,
        kv_layout="engine",
        layout_mode="engine",
        groups=tuple(groups),
        placements=tuple(placements),
        regions=tuple(sorted(out, key=lambda r: (r.group, r.base))),
    )
