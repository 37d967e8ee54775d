"""A tail is stored as its own tokens only: past slot m its pages are zero in the pool, never
the bytes the block's previous owner left there; a load still gives the engine the tail's
exact bytes. Real Mooncake Store on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from app.kvcache.layout import KVLayout
from app.store.master import MasterProcess
from app.store.pool_api import PoolConfig
from app.store.service import PoolService

from .conftest import MiB
from .rank_pools import GEOMETRIES, PresetRank, preset_rank


@pytest.fixture
def service(master: MasterProcess) -> Iterator[PoolService]:
    svc = PoolService(
        PoolConfig(master_address=master.rpc_address, global_segment_size=64 * MiB), tails=True
    )
    asyncio.run(svc.start())
    yield svc
    asyncio.run(svc.stop())


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (random bytes make NaNs, which never compare equal)."""
    return t.contiguous().view(torch.uint8)


def _fill(rank: PresetRank, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for buf in rank.layout.buffers:
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=gen))


@pytest.mark.parametrize(("model", "kv", "stacked"), GEOMETRIES, ids=lambda x: str(x))
def test_a_stored_tail_holds_its_tokens_and_zeros_past_them(
    service: PoolService, model: str, kv: KVLayout, stacked: bool
) -> None:
    engine = preset_rank(model, kv, stacked)  # every byte random: a previous owner's KV
    scratch = preset_rank(model, kv, stacked)  # zeros, where the stored objects land
    _fill(engine, seed=hash((model, kv)) % 1000)
    bs = engine.block_size
    m = 5
    tokens = np.random.default_rng(hash((model, kv, stacked)) % 1000).integers(0, 30000, 2 * bs + m)
    token_ids = [int(t) for t in tokens]
    table = [np.array([3, 1, 4])]
    rp = engine.pool

    async def run() -> None:
        await service.register(rp)
        saved = await service.save(0, token_ids, table, len(token_ids), request="tail")
        assert saved.failed == 0 and not saved.pending
        hashes = rp.group_hashes(token_ids, ())
        name = rp.tail_names(hashes, token_ids, 2 * bs, 2 * bs + m, ())[-1:]
        # Every layer's tail object, read back straight into the scratch rank's block 2.
        keys = rp.tail_keys(0, name)
        pages = [scratch.pool.page(layer, 2) for layer, _ in keys]
        got = await service.client.get_into_async(
            [k for _, k in keys], [p for p, _ in pages], [s for _, s in pages]
        )
        assert got.ok, got

    asyncio.run(run())
    for layer, views in engine.layout.views.items():
        for piece in views:
            mine = _raw(engine.token_view(layer, piece, 4))
            stored = _raw(scratch.token_view(layer, piece, 2))
            assert torch.equal(stored[:m], mine[:m]), (layer, piece)
            assert not stored[m:].any(), (layer, piece)  # nothing of the previous owner's
            assert mine[m:].any()  # (there was something to leak)


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
