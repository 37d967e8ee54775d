"""What a real engine registers (DESIGN §2a): its own KV cache facts, as plain data.

The connector reads these off vLLM's ``kv_cache_config`` and the tensors it allocated; the
sidecar builds its layout from them alone (``engine_layout.describe_engine``). Nothing here is
derived from a preset, and nothing is computed with the planner's formulas: the numbers are the
engine's shapes and strides.
"""

from __future__ import annotations

import msgspec


class Axis(msgspec.Struct, array_like=True):
    """One dimension of a layer's KV tensor: what it means, its size and stride (elements).

    Roles: ``block`` (kernel blocks), ``kv`` (K=0, V=1), ``head``, ``token``, ``channel``.
    Without a ``kv`` axis an attention channel holds K's ``head_size`` channels then V's.
    """

    role: str
    size: int
    stride: int


class StatePart(msgspec.Struct, array_like=True):
    """A TP-sharded slice of a state tensor: ``units`` global units of ``unit_elems`` each."""

    name: str
    units: int
    unit_elems: int


class StateTensor(msgspec.Struct):
    """One state tensor inside a Mamba-style page, as the engine views it.

    ``shape`` is this rank's; ``offset`` is bytes from the page start. For a conv state the
    sub-projections are ``parts`` along the dim axis (``dim_first`` says whether that axis comes
    before the rows); for a temporal state the one part is split over its first axis.
    """

    name: str
    dtype: str
    offset: int
    shape: list[int]
    conv: bool
    dim_first: bool
    parts: list[StatePart]


class EngineLayer(msgspec.Struct):
    """One layer's KV tensor: where its block 0 starts and how it is laid out."""

    name: str
    group: int
    buffer: int  # index into ``EngineRegistration.memory``
    offset: int  # bytes from the buffer start to element 0 of the tensor view
    dtype: str
    axes: list[Axis] = []  # attention and MLA
    head_size: int = 0
    head_size_v: int = 0
    total_heads: int = 0  # KV heads of the whole model (before TP)
    block_stride: int = 0  # bytes; set for state pages (one state per block)
    states: list[StateTensor] = []


class EngineGroup(msgspec.Struct):
    """A KV cache group as the engine built it (vLLM ``KVCacheGroupSpec``)."""

    kind: str  # full | sliding | mla | mamba
    block_size: int
    kernel_block_size: int
    layers: list[str]
    sliding_window: int | None = None
    mamba_mode: str = "none"  # vLLM's mamba_cache_mode: where the final state lives
    num_spec: int = 0  # speculative state blocks after it (align mode)


class MemorySpan(msgspec.Struct, array_like=True):
    """A shared-memory file holding KV: data starts ``offset`` bytes in, ``size`` bytes long."""

    name: str
    offset: int
    size: int


class EngineRegistration(msgspec.Struct):
    """Everything a sidecar needs to move one engine rank's KV, from the engine itself."""

    engine_id: str
    rank: int
    tp_size: int
    model: str  # a readable name; identity is the compat hash over the layer facts
    engine_version: str
    num_blocks: int
    groups: list[EngineGroup]
    layers: list[EngineLayer]
    memory: list[MemorySpan]
    null_block: int = 0
