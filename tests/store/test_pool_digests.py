"""Each page the pool stores carries its digest, checked on load (issue 51, item 4): a page
whose bytes in the pool changed is dropped and its block recomputed; with the digest off
nothing is digested. Real Mooncake Store on loopback, preset ranks in host memory."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from app.kvcache.digest import DigestShare
from app.kvcache.layout import KVLayout
from app.store.digests import digest_key
from app.store.master import MasterProcess
from app.store.pool_api import PoolConfig, StoreLike
from app.store.service import PoolService

from .rank_pools import PresetRank, preset_rank

MiB = 1 << 20


@pytest.fixture
def digest_service(master: MasterProcess, request: pytest.FixtureRequest) -> Iterator[PoolService]:
    """A pool service whose ``kv_digest.share`` is the test's parameter."""
    svc = PoolService(
        PoolConfig(master_address=master.rpc_address, global_segment_size=64 * MiB),
        digest=DigestShare(request.param),
    )
    asyncio.run(svc.start())
    yield svc
    asyncio.run(svc.stop())


def _fill(rank: PresetRank, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for buf in rank.layout.buffers:
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=gen))


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


async def _corrupt_second_block(svc: PoolService, rank: PresetRank, tokens: list[int]) -> str:
    """Overwrite layer 0's page of the prompt's second block in the pool with other bytes of
    the same size (an upsert: a put of an existing key keeps the first object); its key."""
    rp = rank.pool
    (_, _, key), *_ = rp.keys(rp.group_hashes(tokens, ()), 0, [1])
    size = rp.page(0, 0)[1]

    def overwrite(store: StoreLike) -> int:
        return store.upsert_batch([key], [b"\x5a" * size])

    assert await svc.client.run_async(overwrite) == 0
    return key


@pytest.mark.parametrize("digest_service", [1.0], indirect=True)
def test_a_page_changed_in_the_pool_is_dropped_and_its_block_recomputed(
    digest_service: PoolService,
) -> None:
    svc = digest_service
    saver = preset_rank("llama-3.1-8b", KVLayout.HNC, True)
    loader = preset_rank("llama-3.1-8b", KVLayout.HNC, True)
    _fill(saver, seed=11)
    _fill(loader, seed=12)
    tokens = list(range(31000, 31000 + 2 * saver.block_size))

    async def run() -> None:
        await svc.register(saver.pool)
        saved = await svc.save(0, tokens, [np.array([2, 5])], len(tokens), request="s")
        assert saved.stored == 2 * len(saver.pool.desc.groups[0].layers)
        key = await _corrupt_second_block(svc, saver, tokens)
        await svc.register(loader.pool)
        hit = await svc.lookup(0, [*tokens, 1])
        assert hit.hit_tokens == len(tokens)
        out = await svc.load(0, [*tokens, 1], [np.array([1, 3])], len(tokens), request="l")
        # The changed page's block is the engine's to recompute; the other loaded intact.
        assert out.failed_blocks == [[3]], out
        (m,) = out.mismatches
        assert (m.layer, m.group, m.block, m.nbytes) == (0, 0, 3, saver.pool.page(0, 0)[1])
        assert svc.digests.mismatches == {(m.kind, "pool"): 1}
        assert svc.digests.bytes["pool"] > 0  # the counter the digest-off test reads moves
        # Dropped with its digest: a later lookup stops before it, nothing reads it again.
        assert await svc.client.exists_async([key, digest_key(key)]) == [False, False]
        assert (await svc.lookup(0, [*tokens, 1])).hit_tokens == saver.block_size

    asyncio.run(run())
    for layer, views in saver.layout.views.items():
        for piece in views:
            assert torch.equal(
                _raw(loader.token_view(layer, piece, 1)), _raw(saver.token_view(layer, piece, 2))
            )


@pytest.mark.parametrize("digest_service", [0.0], indirect=True)
def test_with_the_digest_off_no_page_is_digested(digest_service: PoolService) -> None:
    """Share 0: no digest is computed on save or load, none is stored, and a changed page
    loads unchecked (what the check above exists for)."""
    svc = digest_service
    saver = preset_rank("llama-3.1-8b", KVLayout.HNC, True)
    loader = preset_rank("llama-3.1-8b", KVLayout.HNC, True)
    _fill(saver, seed=13)
    tokens = list(range(32000, 32000 + 2 * saver.block_size))

    async def run() -> None:
        await svc.register(saver.pool)
        await svc.save(0, tokens, [np.array([2, 5])], len(tokens), request="s")
        key = await _corrupt_second_block(svc, saver, tokens)
        assert await svc.client.exists_async([digest_key(key)]) == [False]
        await svc.register(loader.pool)
        out = await svc.load(0, [*tokens, 1], [np.array([1, 3])], len(tokens), request="l")
        assert out.failed_blocks == [[]] and not out.mismatches
        assert (sum(svc.digests.bytes.values()), sum(svc.digests.runs.values())) == (0, 0)

    asyncio.run(run())
