"""A tail's load gives the engine the tail's exact bytes, into another engine's blocks that
held someone else's bytes. Real Mooncake Store on loopback."""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from app.kvcache.layout import KVLayout
from app.store.service import PoolService

from .rank_pools import PresetRank, preset_rank


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (random bytes make NaNs, which never compare equal)."""
    return t.contiguous().view(torch.uint8)


def _fill(rank: PresetRank, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for buf in rank.layout.buffers:
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=gen))


def test_a_tails_load_gives_the_engine_its_exact_bytes(service: PoolService) -> None:
    saver = preset_rank("llama-3.1-8b", KVLayout.HNC, True)
    loader = preset_rank("llama-3.1-8b", KVLayout.HNC, True)
    _fill(saver, seed=7)
    _fill(loader, seed=8)  # the loader's block also holds someone's bytes
    bs = saver.block_size
    m = 9
    token_ids = list(range(9000, 9000 + bs + m))

    async def run() -> None:
        await service.register(saver.pool)
        await service.save(0, token_ids, [np.array([2, 5])], len(token_ids), request="s")
        hit = await service.lookup(0, [*token_ids, 1])  # one more token to compute
        assert hit.hit_tokens == bs + m
        # The loader is another rank 0 (another engine): register it in the saver's place.
        await service.register(loader.pool)
        out = await service.load(0, [*token_ids, 1], [np.array([1, 3])], bs + m, request="l")
        assert out.failed_blocks == [[]] and not out.pending

    asyncio.run(run())
    for layer, views in saver.layout.views.items():
        for piece in views:
            assert torch.equal(
                _raw(loader.token_view(layer, piece, 1)), _raw(saver.token_view(layer, piece, 2))
            )
            assert torch.equal(
                _raw(loader.token_view(layer, piece, 3))[:m],
                _raw(saver.token_view(layer, piece, 5))[:m],
            )
