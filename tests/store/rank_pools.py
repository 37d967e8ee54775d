"""Preset ranks in host memory as the sidecar's pool sees a real engine's (``RankPool``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.kvcache.engine_layout import describe_engine
from app.kvcache.groups import build_cache_config
from app.kvcache.layout import KVLayout, LayoutMode, RankLayout, allocate
from app.kvcache.preset_registration import preset_registration
from app.kvcache.presets import load_preset
from app.store.rank_pool import RankPool

# (model, layout, stacked): vLLM CPU's own is HNC stacked; MLA is one latent row per token.
GEOMETRIES = [
    ("llama-3.1-8b", KVLayout.HNC, True),
    ("llama-3.1-8b", KVLayout.NHD, False),
    ("llama-3.1-8b", KVLayout.HND, False),
    ("deepseek-v3.2-exp", KVLayout.HND, False),
]


@dataclass(frozen=True)
class PresetRank:
    layout: RankLayout
    pool: RankPool

    @property
    def block_size(self) -> int:
        return self.layout.config.groups[0].block_size

    def token_view(self, layer: int, piece: str, block: int) -> torch.Tensor:
        """``layer``'s ``piece`` of ``block`` with tokens first: [tokens, ...]."""
        view = self.layout.views[layer][piece][block]  # [ratio, ...]
        kb = self.block_size // view.shape[0]
        axis = 2 if self.layout.kv_layout is KVLayout.HND and piece in ("k", "v") else 1
        per_kernel = view.movedim(axis, 1)  # [ratio, kb, ...]
        assert per_kernel.shape[1] == kb
        return per_kernel.reshape(self.block_size, *per_kernel.shape[2:])


def preset_rank(
    model: str, kv: KVLayout, stacked: bool, *, layers: int = 2, num_blocks: int = 6
) -> PresetRank:
    spec = load_preset(model, layers=layers)
    cfg = build_cache_config(spec, 1, spec.default_block_size(), num_blocks=num_blocks)
    layout = allocate(cfg, 0, mode=LayoutMode.PER_LAYER, kv_layout=kv, stacked=stacked)
    reg = preset_registration(layout)
    desc = describe_engine(reg, [b.data_ptr() for b in layout.buffers])
    return PresetRank(layout, RankPool.from_engine(desc, reg, layout.spans()))
