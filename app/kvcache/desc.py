"""What a peer needs to know about a rank's KV cache to write into it (no tensors, only numbers).

It travels in ``AgentMetadata`` and is what the planner and the validation gate read, for the
local side as well as the remote one.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.kvcache.layout import LayerPlacement, RankLayout, Region
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


def describe(layout: RankLayout) -> LayoutDesc:
    """The peer-facing description of a rank's layout."""
    cfg = layout.config
    return LayoutDesc(
        compat_hash=cfg.model.compat_hash(),
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
