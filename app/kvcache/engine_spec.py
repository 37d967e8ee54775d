"""What a real engine registers (DESIGN §2a): its own KV cache facts, as plain data.

The connector reads these off vLLM's ``kv_cache_config`` and the tensors it allocated; the
sidecar builds its layout from them alone (``engine_layout.describe_engine``). Nothing here is
derived from a preset, and nothing is computed with the planner's formulas: the numbers are the
engine's shapes and strides.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from app.devices.spec import DeviceBuffer, EventRingSpec, FdSource

# Bounds a registration must meet to decode at all: an engine (or a process on its socket) that
# sends a negative offset, a TP size of 0 or a billion-entry shape gets a ProtocolError naming
# the field, not an exception deep in the layout code or memory it cannot map. Generous
# against every model in ../models: the largest have ~100 layers, 128 KV heads, 6 groups.
_BIG = 1 << 48  # bytes and elements: more than any device or host holds
Count = Annotated[int, msgspec.Meta(ge=0, le=_BIG)]
Size = Annotated[int, msgspec.Meta(ge=1, le=_BIG)]
Small = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]  # heads, head sizes, tokens per block
Name = Annotated[str, msgspec.Meta(max_length=256)]
Dims = Annotated[list[Size], msgspec.Meta(max_length=8)]


class Axis(msgspec.Struct, array_like=True):
    """One dimension of a layer's KV tensor: what it means, its size and stride (elements).

    Roles: ``block`` (kernel blocks), ``kv`` (K=0, V=1), ``head``, ``token``, ``channel``.
    With a ``kernel`` axis (kernel blocks of one block; simulated cross-layer layouts only)
    ``block`` counts manager blocks instead.
    Without a ``kv`` axis an attention channel holds K's ``head_size`` channels then V's.
    """

    role: Name
    size: Size
    stride: Count


class StatePart(msgspec.Struct, array_like=True):
    """A TP-sharded slice of a state tensor: ``units`` global units of ``unit_elems`` each."""

    name: Name
    units: Size
    unit_elems: Size


class StateTensor(msgspec.Struct):
    """One state tensor inside a Mamba-style page, as the engine views it.

    ``shape`` is this rank's; ``offset`` is bytes from the page start. For a conv state the
    sub-projections are ``parts`` along the dim axis (``dim_first`` says whether that axis comes
    before the rows); for a temporal state the one part is split over its first axis.
    """

    name: Name
    dtype: Name
    offset: Count
    shape: Dims
    conv: bool
    dim_first: bool
    parts: Annotated[list[StatePart], msgspec.Meta(max_length=16)]


class EngineLayer(msgspec.Struct):
    """One layer's KV tensor: where its block 0 starts and how it is laid out."""

    name: Name
    group: Annotated[int, msgspec.Meta(ge=0, lt=64)]
    buffer: Annotated[int, msgspec.Meta(ge=0, lt=4096)]  # index into ``memory``
    offset: Count  # bytes from the buffer start to element 0 of the tensor view
    dtype: Name
    axes: Annotated[list[Axis], msgspec.Meta(max_length=8)] = []  # attention and MLA
    head_size: Small = 0
    head_size_v: Small = 0
    total_heads: Small = 0  # KV heads of the whole model (before TP)
    block_stride: Count = 0  # bytes; set for state pages (one state per block)
    states: Annotated[list[StateTensor], msgspec.Meta(max_length=8)] = []


class EngineGroup(msgspec.Struct):
    """A KV cache group as the engine built it (vLLM ``KVCacheGroupSpec``)."""

    kind: Name  # full | sliding | mla | mamba
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 30)]
    kernel_block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 30)]
    layers: Annotated[list[Name], msgspec.Meta(max_length=4096)]
    sliding_window: Annotated[int, msgspec.Meta(ge=1, le=1 << 30)] | None = None
    mamba_mode: Name = "none"  # vLLM's mamba_cache_mode: where the final state lives
    num_spec: Annotated[int, msgspec.Meta(ge=0, le=64)] = 0  # speculative state blocks after it


class MemorySpan(msgspec.Struct, array_like=True):
    """A shared-memory file holding KV: data starts ``offset`` bytes in, ``size`` bytes long."""

    name: Name
    offset: Count
    size: Size


class EngineRegistration(msgspec.Struct):
    """Everything a sidecar needs to move one engine rank's KV, from the engine itself."""

    engine_id: Name
    rank: Annotated[int, msgspec.Meta(ge=0, lt=1024)]
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=1024)]
    model: Name  # a readable name; identity is the compat hash over the layer facts
    engine_version: Name
    num_blocks: Annotated[int, msgspec.Meta(ge=1, le=1 << 31)]
    groups: Annotated[list[EngineGroup], msgspec.Meta(min_length=1, max_length=64)]
    layers: Annotated[list[EngineLayer], msgspec.Meta(min_length=1, max_length=4096)]
    memory: Annotated[list[MemorySpan], msgspec.Meta(min_length=1, max_length=4096)]
    null_block: Annotated[int, msgspec.Meta(ge=0, le=1 << 31)] = 0
    # The rank's event ring (app.devices.events); None: layers are complete when signalled.
    events: EventRingSpec | None = None
    # Device KV (CUDA/NPU): ``memory[i]`` is then ``device_memory[i]`` (its name a label, its
    # offset 0), imported by IPC instead of mapped from /dev/shm (app.devices.memory).
    device_memory: Annotated[list[DeviceBuffer], msgspec.Meta(max_length=4096)] | None = None
    # CPU KV registered again with a new sidecar: the /dev/shm names of ``memory`` were removed
    # once the first sidecar mapped them, so the engine serves each span's file as a descriptor
    # here instead, in order (app.devices.fdpass).
    memory_fds: FdSource | None = None
    # The engine's speculative decoding settings ("" when off): both sides must run the same.
    speculative: Name = ""
    # The /dev/shm name of the rank's finished bell (app.devices.bell); None: none.
    bell: Name | None = None
    # The KV pool (app.store): which weights and KV dtypes computed this KV (a digest of the
    # checkpoint's identity, "" when unknown), and the groups whose last matched block vLLM's
    # prefix cache drops under EAGLE/MTP (empty: no drop).
    checkpoint: Name = ""
    # The names clients call the base model by (vLLM's served_model_name): a router's pool
    # lookup for any other ``model`` is an adapter's.
    served_models: Annotated[list[Name], msgspec.Meta(max_length=16)] = []
    eagle_groups: Annotated[
        list[Annotated[int, msgspec.Meta(ge=0, lt=64)]], msgspec.Meta(max_length=64)
    ] = []
