"""What a pool key names besides the tokens (issue 50, items 2, 6 and 8), on a real Mooncake
Store: the checkpoint an engine registered and the operator's namespace (other weights never
hit), the EAGLE groups (vLLM's last-block drop) and speculative decoding (no tails), the tenant
of a router's lookup, and a prompt one token past a block boundary hitting every block."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np

from app.kvcache.engine_layout import describe_engine
from app.kvcache.layout import KVLayout
from app.kvcache.preset_registration import preset_registration
from app.store.rank_pool import RankPool
from app.store.service import PoolService

from .rank_pools import PresetRank, preset_rank

_ALIVE: list[PresetRank] = []
SALTED = [(1, [("cache_salt", "tenant-1")]), (0, [])]


def _rank(namespace: str = "", **fields: object) -> tuple[PresetRank, RankPool]:
    """A Llama rank whose registration carries ``fields`` (checkpoint, eagle groups, ...)."""
    engine = preset_rank("llama-3.1-8b", KVLayout.HNC, True, num_blocks=12)
    _ALIVE.append(engine)  # the store reads and writes its memory until the module ends
    reg = msgspec.structs.replace(preset_registration(engine.layout), **fields)
    desc = describe_engine(reg, [b.data_ptr() for b in engine.layout.buffers])
    return engine, RankPool.from_engine(desc, reg, engine.layout.spans(), namespace)


def _prompt(blocks: int, extra: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, 30000, blocks * 16 + extra)]


async def _use(svc: PoolService, rp: RankPool) -> None:
    """Make ``rp`` the service's rank 0 (its memory is registered once)."""
    if svc.ranks.get(0) is not rp:
        await svc.register(rp)


def _stored(svc: PoolService, rp: RankPool, tokens: list[int], runs: object = ()) -> None:
    table = [np.arange(1, 1 + -(-len(tokens) // 16))]

    async def run() -> None:
        await _use(svc, rp)
        out = await svc.save(0, tokens, table, len(tokens), runs)  # type: ignore[arg-type]
        assert out.failed == 0 and out.stored > 0, out

    asyncio.run(run())


def _hit(svc: PoolService, rp: RankPool, tokens: list[int], runs: object = ()) -> int:
    async def run() -> int:
        await _use(svc, rp)
        return (await svc.lookup(0, tokens, runs)).hit_tokens  # type: ignore[arg-type]

    return asyncio.run(run())


def test_k_blocks_and_one_token_hit_k_blocks(service: PoolService) -> None:
    _, rp = _rank(checkpoint="k-plus-one")
    tokens = _prompt(8, 1, seed=1)  # 129 tokens
    _stored(service, rp, tokens[:128])
    # The lookup takes the whole prompt and leaves only its last token, as vLLM does.
    assert _hit(service, rp, tokens) == 128


def test_other_weights_or_another_namespace_never_hit(service: PoolService) -> None:
    tokens = _prompt(4, 0, seed=2)
    _, first = _rank(checkpoint="weights-a")
    _stored(service, first, tokens)
    lookup = [*tokens, 7]
    assert _hit(service, _rank(checkpoint="weights-a")[1], lookup) == 64  # the same weights
    assert _hit(service, _rank(checkpoint="weights-b")[1], lookup) == 0
    assert _hit(service, _rank("blue", checkpoint="weights-a")[1], lookup) == 0


def test_a_salted_prompt_hits_only_its_tenants_blocks(service: PoolService) -> None:
    tokens = _prompt(4, 0, seed=3)
    _, rp = _rank(checkpoint="salts", served_models=["base"])
    _stored(service, rp, tokens, SALTED)
    lookup = [*tokens, 7]
    assert _hit(service, rp, lookup, SALTED) == 64
    assert _hit(service, rp, lookup) == 0
    assert _hit(service, rp, lookup, [(1, [("cache_salt", "tenant-2")]), (0, [])]) == 0

    async def router(salt: str | None, model: str | None) -> int:
        return (await service.router_lookup(lookup, salt, model))[0]

    assert asyncio.run(router("tenant-1", "base")) == 64
    assert asyncio.run(router(None, "base")) == 0
    assert asyncio.run(router("tenant-1", "an-adapter")) == 0  # no engine here used it


def test_an_adapters_blocks_are_hit_by_that_adapter_only(service: PoolService) -> None:
    tokens = _prompt(4, 0, seed=4)
    lora = [(0, [("lora", "sql", "/adapters/sql")])]
    _, rp = _rank(checkpoint="adapters", served_models=["base"])
    _stored(service, rp, tokens, lora)
    lookup = [*tokens, 7]

    async def router(model: str) -> int:
        return (await service.router_lookup(lookup, None, model))[0]

    assert asyncio.run(router("sql")) == 64  # learned from the engine's own save
    assert asyncio.run(router("base")) == 0
    assert _hit(service, rp, lookup, lora) == 64
    assert _hit(service, rp, lookup) == 0
    # The same name pointed at other weights (the path is part of vLLM's key).
    assert _hit(service, rp, lookup, [(0, [("lora", "sql", "/adapters/sql-v2")])]) == 0


def test_eagle_drops_the_last_block_and_speculative_decoding_takes_no_tails(
    service: PoolService,
) -> None:
    tokens = _prompt(4, 5, seed=5)  # 4 blocks and a tail of 5
    _, plain = _rank(checkpoint="spec")
    _stored(service, plain, tokens)
    lookup = [*tokens, 7]  # one more token to compute
    assert _hit(service, plain, lookup) == 69  # every block and the tail
    _, eagle = _rank(checkpoint="spec", eagle_groups=[0], speculative="method=eagle")
    assert _hit(service, eagle, lookup) == 48  # vLLM drops the last matched block; no tail
    _, ngram = _rank(checkpoint="spec", speculative="method=ngram")
    assert _hit(service, ngram, lookup) == 64  # whole blocks only
