"""What a peer needs to know about a rank's KV cache to write into it (no tensors, only numbers).

It travels in ``AgentMetadata`` as it is (a msgspec Struct, frozen so it hashes and compares by
value) and is what the planner and the validation gate read, for the local side as well as the
remote one.
"""

from __future__ import annotations

from functools import cached_property

import msgspec

from app.kvcache.bounds import Index, NonNegInt, Positive, TpSize
from app.kvcache.layout import LayerPlacement, Region
from app.kvcache.specs import SpecKind


class GroupDesc(msgspec.Struct, frozen=True):
    index: Index
    kind: SpecKind
    block_size: Positive
    kernel_block_size: Positive
    layers: tuple[Index, ...]
    sliding_window: Positive | None = None

    @property
    def ratio(self) -> int:
        return self.block_size // self.kernel_block_size


# dict=True: room for the cached per-layer index (not a field, so never on the wire).
class LayoutDesc(msgspec.Struct, frozen=True, dict=True):
    compat_hash: str
    tp: TpSize
    rank: Index
    num_blocks: NonNegInt
    null_block: Index
    kv_layout: str
    layout_mode: str
    groups: tuple[GroupDesc, ...]
    placements: tuple[LayerPlacement, ...]
    regions: tuple[Region, ...]

    def placement(self, layer: int) -> LayerPlacement:
        return self._by_layer[layer]

    @cached_property
    def _by_layer(self) -> dict[int, LayerPlacement]:
        return {p.layer: p for p in self.placements}
