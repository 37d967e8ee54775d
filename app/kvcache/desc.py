"""What a peer needs to know about a rank's KV cache to write into it (no tensors, only numbers).

It travels in ``AgentMetadata`` and is what the planner and the validation gate read, for the
local side as well as the remote one.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.kvcache.layout import LayerPlacement, Region
from app.kvcache.specs import SpecKind


@dataclass(frozen=True)
class GroupDesc:
    index: int
    kind: SpecKind
    block_size: int
    kernel_block_size: int
    layers: tuple[int, ...]
    sliding_window: int | None = None

    @property
    def ratio(self) -> int:
        return self.block_size // self.kernel_block_size


@dataclass(frozen=True)
class LayoutDesc:
    compat_hash: str
    tp: int
    rank: int
    num_blocks: int
    null_block: int
    kv_layout: str
    layout_mode: str
    groups: tuple[GroupDesc, ...]
    placements: tuple[LayerPlacement, ...]
    regions: tuple[Region, ...]

    def placement(self, layer: int) -> LayerPlacement:
        return self._by_layer()[layer]

    def _by_layer(self) -> dict[int, LayerPlacement]:
        cached: dict[int, LayerPlacement] | None = self.__dict__.get("_index")
        if cached is None:
            cached = {p.layer: p for p in self.placements}
            object.__setattr__(self, "_index", cached)
        return cached
