"""A preset-allocated rank as the registration a real engine sends (DESIGN §2a).

``preset_registration`` reads a ``RankLayout`` the way the vLLM connector reads vLLM's tensors:
groups and layer names from the cache config, and each layer's geometry from its zero-copy
views (data pointer, shape, strides), never from the layout's pieces. The sidecar builds its
layout from that with ``describe_engine`` alone, whether the rank is vLLM's or simulated.

``describe`` is the planner's view of a preset rank (``kv-sidecar plan``, bench plans, the
in-process reference); its compat hash is the one ``describe_engine`` gives the registration.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from app.devices.spec import DeviceBuffer, EventRingSpec
from app.errors import ConfigError
from app.kvcache.desc import GroupDesc, LayoutDesc
from app.kvcache.engine_layout import engine_compat_hash
from app.kvcache.engine_spec import (
    Axis,
    EngineGroup,
    EngineLayer,
    EngineRegistration,
    MemorySpan,
    StatePart,
    StateTensor,
)
from app.kvcache.layout import KVLayout, RankLayout
from app.kvcache.specs import (
    PACKED_MLA_BYTES,
    AttentionSpec,
    MambaSpec,
    MLASpec,
    SpecKind,
    dtype_size,
)

_KIND = {
    SpecKind.FULL: "full",
    SpecKind.SLIDING: "sliding",
    SpecKind.MLA: "mla",
    SpecKind.MAMBA: "mamba",
}


def _lead_axes(view: torch.Tensor, ratio: int) -> list[Axis]:
    """The block axes of a ``[blocks, kernel blocks, ...]`` view, in elements.

    vLLM hands one axis of kernel blocks; a layout whose manager block is not ``ratio``
    contiguous kernel blocks (cross-layer with kernel blocks smaller than the block, the
    heads-major variant) needs a separate ``kernel`` axis, which vLLM never sends.
    """
    n, r = int(view.shape[0]), int(view.shape[1])
    block, kernel = int(view.stride(0)), int(view.stride(1))
    if r != ratio:
        raise ConfigError(f"view has {r} kernel blocks per block, the group {ratio}")
    if block == r * kernel:
        return [Axis("block", n * r, kernel)]
    return [Axis("block", n, block), Axis("kernel", r, kernel)]


def _attention(
    name: str, views: dict[str, torch.Tensor], spec: AttentionSpec, layout: RankLayout, ratio: int
) -> tuple[int, list[Axis]]:
    """(data pointer of element 0, axes) of an attention layer's K and V views."""
    k, v = views["k"], views["v"]
    size = k.element_size()
    if layout.kv_layout is KVLayout.HND:  # [n, r, heads, tokens, head_size]
        head, token = (int(k.shape[2]), int(k.stride(2))), (int(k.shape[3]), int(k.stride(3)))
    else:  # [n, r, tokens, heads, head_size]
        token, head = (int(k.shape[2]), int(k.stride(2))), (int(k.shape[3]), int(k.stride(3)))
    axes = _lead_axes(k, ratio)
    if layout.kv_layout is KVLayout.HNC:
        # V's channels follow K's in each token row: one channel axis of both, no kv axis.
        if v.data_ptr() - k.data_ptr() != spec.head_size * size:
            raise ConfigError(f"layer {name}: V does not follow K inside the token row")
        channel = spec.head_size + spec.head_size_v
    else:
        if spec.head_size_v != spec.head_size:
            raise ConfigError(
                f"layer {name}: K and V head sizes differ ({spec.head_size}, "
                f"{spec.head_size_v}); a kv axis needs equal ones, use --kv-layout HNC"
            )
        axes.append(Axis("kv", 2, (v.data_ptr() - k.data_ptr()) // size))
        channel = spec.head_size
    axes += [Axis("head", head[0], head[1]), Axis("token", token[0], token[1])]
    axes.append(Axis("channel", channel, int(k.stride(-1))))
    return k.data_ptr(), axes


def _layer(layout: RankLayout, li: int, buffer_ptr: int) -> EngineLayer:
    cfg = layout.config
    cache = cfg.model.layers[li]
    pl = layout.placements[li]
    group = cfg.groups[pl.group]
    views = layout.views[li]
    spec = cache.spec
    if isinstance(spec, AttentionSpec):
        ptr, axes = _attention(cache.name, views, spec, layout, group.ratio)
        return EngineLayer(
            name=cache.name,
            group=pl.group,
            buffer=pl.buffer,
            offset=ptr - buffer_ptr,
            dtype=spec.dtype,
            axes=axes,
            head_size=spec.head_size,
            head_size_v=spec.head_size_v,
            total_heads=spec.num_kv_heads,
        )
    if isinstance(spec, MLASpec):
        latent = views["latent"]  # uint8 [n, r, tokens, row bytes]
        dtype = "uint8" if spec.cache_dtype in PACKED_MLA_BYTES else spec.dtype
        elem = dtype_size(dtype)
        row = int(latent.shape[3])
        lead = [Axis(a.role, a.size, a.stride // elem) for a in _lead_axes(latent, group.ratio)]
        return EngineLayer(
            name=cache.name,
            group=pl.group,
            buffer=pl.buffer,
            offset=latent.data_ptr() - buffer_ptr,
            dtype=dtype,
            axes=[
                *lead,
                Axis("token", int(latent.shape[2]), int(latent.stride(2)) // elem),
                Axis("channel", row // elem, 1),
            ],
            head_size=spec.head_size,
            total_heads=1,
        )
    return _state_layer(layout, li, buffer_ptr, spec)


def _state_layer(layout: RankLayout, li: int, buffer_ptr: int, spec: MambaSpec) -> EngineLayer:
    cache = layout.config.model.layers[li]
    pl = layout.placements[li]
    views = layout.views[li]
    first = views[spec.states[0].name]  # the page starts with the first state
    states = []
    for st in spec.states:
        view = views[st.name]  # [n, *shape]
        states.append(
            StateTensor(
                st.name,
                st.dtype,
                view.data_ptr() - first.data_ptr(),
                [int(x) for x in view.shape[1:]],
                st.conv,
                st.conv and spec.conv_layout == "DS",
                [StatePart(p.name, p.units, p.unit_elems) for p in st.parts],
            )
        )
    return EngineLayer(
        name=cache.name,
        group=pl.group,
        buffer=pl.buffer,
        offset=first.data_ptr() - buffer_ptr,
        dtype="uint8",
        block_stride=int(first.stride(0)) * first.element_size(),
        states=states,
    )


def preset_registration(
    layout: RankLayout,
    *,
    engine_id: str = "preset",
    memory: Sequence[MemorySpan] | None = None,
    events: EventRingSpec | None = None,
    device_memory: Sequence[DeviceBuffer] | None = None,
) -> EngineRegistration:
    """What an engine holding ``layout`` registers. ``memory[i]`` names ``layout.buffers[i]``
    (its shared-memory file; default: a label, for planning)."""
    cfg = layout.config
    buffers = layout.buffers
    spans = (
        list(memory)
        if memory is not None
        else [MemorySpan(f"buffer-{i}", 0, b.numel()) for i, b in enumerate(buffers)]
    )
    if len(spans) != len(buffers):
        raise ConfigError(f"{len(buffers)} buffers allocated, {len(spans)} memory spans named")
    groups = [
        EngineGroup(
            _KIND[g.kind],
            g.block_size,
            g.kernel_block_size,
            [c.name for c in g.layers],
            g.sliding_window,
        )
        for g in cfg.groups
    ]
    layers = [
        _layer(layout, c.index, buffers[layout.placements[c.index].buffer].data_ptr())
        for c in cfg.model.layers
    ]
    return EngineRegistration(
        engine_id=engine_id,
        rank=layout.rank,
        tp_size=cfg.tp,
        model=cfg.model.name,
        engine_version=f"preset (vLLM {cfg.model.vllm_version} formulas)",
        num_blocks=cfg.num_blocks,
        groups=groups,
        layers=layers,
        memory=spans,
        null_block=layout.null_block,
        events=events,
        device_memory=list(device_memory) if device_memory is not None else None,
    )


def describe(layout: RankLayout) -> LayoutDesc:
    """The peer-facing description of a preset rank, for planning without a sidecar; the
    compat hash is the registration's, so it matches what the sidecar announces."""
    cfg = layout.config
    return LayoutDesc(
        compat_hash=engine_compat_hash(preset_registration(layout)),
        tp=cfg.tp,
        rank=layout.rank,
        num_blocks=cfg.num_blocks,
        null_block=layout.null_block,
        kv_layout=layout.kv_layout.value,
        layout_mode=layout.mode.value
        + ("+heads_major" if layout.heads_major else "")
        + ("+stacked" if layout.stacked else ""),
        groups=tuple(
            GroupDesc(
                g.index,
                g.kind,
                g.block_size,
                g.kernel_block_size,
                tuple(c.index for c in g.layers),
                g.sliding_window,
            )
            for g in cfg.groups
        ),
        placements=tuple(layout.placements[k] for k in sorted(layout.placements)),
        regions=tuple(layout.regions()),
    )
