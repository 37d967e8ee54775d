"""The KV pool as the sidecar serves it to its engines: lookup, save after prefill, load.

A pool object is one layer's page of one block, keyed by (model identity, dtype, layout, TP
namespace, layer, block hash): pages of different layers live in different tensors, and a
Mooncake Store object is one contiguous span. Every rank stores its own shard under a namespace
that ranks holding identical bytes share (see ``keys.tp_namespace``), so a pool written at one TP
size is read back at the same TP size; a different TP size simply misses.

Mamba-style state pages are keyed like attention pages (the state block at a block boundary);
the coordinator decides which of them a hit needs.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from app.errors import ConfigError
from app.kvcache.digest import DigestMismatch, DigestShare, DigestStats
from app.store.coordinator import CacheHit
from app.store.digests import Page, check_digests, drawn, store_digests
from app.store.hashing import KeyRun
from app.store.pool import PoolClient
from app.store.pool_api import PoolConfig
from app.store.rank_pool import RankPool
from app.store.running import RunningCalls
from app.store.tenants import TenantKeys

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveOutcome:
    stored: int
    skipped: int
    backpressure: int
    failed: int
    bytes: int
    # The put ran past the pool's timeout and still reads the blocks: the engine keeps them
    # until a poll finds it returned (``running.RunningCalls``).
    pending: bool = False


@dataclass(frozen=True)
class PoolCall:
    """One engine save or load, for ``/v1/pool``'s ``recent`` (what a person debugging a
    wrong answer asks first: which blocks of the request were written or read)."""

    kind: Literal["save", "load"]
    request: str
    rank: int
    tokens: int  # stored prefix, or the hit loaded
    held_tokens: int  # a load's tokens the engine's own cache held (0 for a save)
    blocks: list[list[int]]  # per group, the block indices stored or loaded
    block_ids: list[list[int]]  # per group, the request's block table as the engine sent it
    started_at: float  # Unix seconds: the call reached the pool service
    ended_at: float | None  # Unix seconds: the store answered (None: it has not yet)
    # "done": answered in time; "running": the store call has not returned (past the timeout,
    # the engine holds the blocks for it); "late": it returned after the timeout.
    state: Literal["done", "running", "late"] = "done"


RECENT_CALLS = 32


@dataclass
class CallCounters:
    """Totals for ``/metrics``: what loads fetched, the blocks they left alone because the
    engine already held them from its own cache hit, and the saves (``saves_cut``: those that
    stored a shorter prefix than the request computed, its window's tail being gone)."""

    loads: int = 0
    keys: int = 0
    bytes: int = 0
    local_blocks: int = 0
    saves: int = 0
    saves_cut: int = 0


@dataclass(frozen=True)
class LoadOutcome:
    loaded: int
    bytes: int
    failed_blocks: list[list[int]]  # per group: block ids the engine must recompute
    # The get ran past the pool's timeout and may still write the blocks: the engine keeps
    # them, and the request waits, until a poll finds it returned (then it recomputes).
    pending: bool = False
    # Pages whose digest differed (``app.store.digests``): dropped, their blocks in
    # ``failed_blocks``.
    mismatches: tuple[DigestMismatch, ...] = ()


class PoolService:
    """One Mooncake Store client for the sidecar; one ``RankPool`` per registered rank."""

    def __init__(
        self,
        config: PoolConfig,
        *,
        tails: bool = False,
        namespace: str = "",
        digest: DigestShare | None = None,
    ) -> None:
        self.client = PoolClient(config)
        # ``kv_digest.share``: the pages whose digests saves store and loads check.
        self.digest = digest if digest is not None else DigestShare(0.0)
        self.digests = DigestStats()
        self.namespace = namespace  # the operator's, in every key (``RankPool.from_engine``)
        # Store a request's last partial block and hit it (``hashing.tail_hash``), where the
        # model's groups allow it (``PoolCoordinator.takes_tails``).
        self.tails = tails
        self.ranks: dict[int, RankPool] = {}
        self.tenants = TenantKeys()
        self.lookups = 0
        self.hit_tokens = 0
        self.calls = CallCounters()
        self.recent: deque[PoolCall] = deque(maxlen=RECENT_CALLS)
        self.running = RunningCalls(config.quarantine_max_s)

    async def start(self) -> None:
        await self.client.start_async()

    async def stop(self) -> None:
        await self.client.close_async()

    async def register(self, rank: RankPool) -> None:
        """Register a rank's memory with the store client (again after a re-registration)."""
        self.ranks[rank.desc.rank] = rank
        self.tenants.serve(rank.served_models)
        for ptr, length in rank.spans:
            await self.client.register_async(ptr, length)

    def _rank(self, rank: int) -> RankPool:
        rp = self.ranks.get(rank)
        if rp is None:
            raise ConfigError(f"rank {rank} has not registered its KV caches for the pool")
        return rp

    async def lookup(
        self,
        rank: int,
        token_ids: Sequence[int],
        extra_keys: Sequence[KeyRun] = (),
        count: bool = True,
    ) -> CacheHit:
        """The longest prefix the pool can serve, as vLLM's hybrid coordinator computes it
        (``count``: an engine's lookup, in ``lookups`` and ``hit_tokens``)."""
        rp = self._rank(rank)
        hashes = rp.group_hashes(token_ids, extra_keys)
        entries = [
            (g, e) for g in range(len(hashes)) for e in rp.keys(hashes, g, range(len(hashes[g])))
        ]
        found = await self.client.exists_async([k for _, (_, _, k) in entries]) if entries else []
        masks = [np.ones(len(h), dtype=bool) for h in hashes]
        for (g, (_, b, _)), ok in zip(entries, found, strict=True):
            masks[g][b] &= ok
        hit = rp.coordinator.find_longest_cache_hit([m.tolist() for m in masks], len(token_ids))
        if self._tails(rp):
            tail = await self._tail_hit(rp, hashes, token_ids, extra_keys, hit.hit_tokens)
            hit = dataclasses.replace(hit, hit_tokens=hit.hit_tokens + tail)
        if count:
            self.lookups += 1
            self.hit_tokens += hit.hit_tokens
            self.tenants.learn(extra_keys)
        return hit

    def stores_tails(self, rank: int) -> bool:
        """Whether this rank's requests have their last partial block stored (and hit)."""
        return self._tails(self._rank(rank))

    def _tails(self, rp: RankPool) -> bool:
        return self.tails and rp.coordinator.takes_tails and not rp.speculative

    async def _tail_hit(
        self,
        rp: RankPool,
        hashes: list[list[bytes]],
        token_ids: Sequence[int],
        extra_keys: Sequence[KeyRun],
        full: int,
    ) -> int:
        """The longest stored tail after a hit of ``full`` tokens, leaving the last token to
        compute as the full blocks do: one existence check of every length's first key, then
        every key of the longest found (a tail some layer lacks is no hit)."""
        room = min(rp.coordinator.lcm_block_size - 1, len(token_ids) - 1 - full)
        if room < 1:
            return 0
        names = rp.tail_names(hashes, token_ids, full, full + room, extra_keys)
        # The first layer's key of every length (tail_keys lists layer by layer).
        probes = await self.client.exists_async([k for _, k in rp.tail_keys(0, names)[:room]])
        for m in range(room, 0, -1):
            if not probes[m - 1]:
                continue
            name = [names[m - 1]]
            keys = [k for g in range(len(rp.desc.groups)) for _, k in rp.tail_keys(g, name)]
            if all(await self.client.exists_async(keys)):
                return m
        return 0

    async def router_lookup(
        self, token_ids: Sequence[int], cache_salt: str | None = None, model: str | None = None
    ) -> tuple[int, int]:
        """(hit tokens, block size) for a router weighing where a prompt goes (the whole
        prompt: the hit leaves its last token, as the engine's does), keyed by the tenant's
        salt and adapter (``tenants``): the lowest registered rank's lookup stands for every
        rank, as the connector's does; (0, 0) before any rank registered, and no hit for an
        adapter no engine here has used. Not counted as an engine's lookup."""
        if not self.ranks:
            return 0, 0
        rank = min(self.ranks)
        runs = self.tenants.runs(cache_salt, model)
        block = max(g.block_size for g in self.ranks[rank].desc.groups)
        if runs is None:
            return 0, block
        hit = await self.lookup(rank, token_ids, runs, count=False)
        return hit.hit_tokens, block

    async def save(
        self,
        rank: int,
        token_ids: Sequence[int],
        block_ids: Sequence[np.ndarray],
        num_computed: int,
        extra_keys: Sequence[KeyRun] = (),
        request: str = "",
        stored_tokens: int = 0,
    ) -> SaveOutcome:
        """Store the fully computed blocks the coordinator's store masks name (the caller
        keeps them pinned until this returns), less those ending at or before
        ``stored_tokens``: a running request's earlier saves stored them (every group's needs
        at that boundary, and a later boundary needs no block of a group before it that the
        earlier one did not)."""
        started = time.time()
        rp = self._rank(rank)
        hashes = rp.group_hashes(token_ids[:num_computed], extra_keys)
        self.tenants.learn(extra_keys)
        keys, ptrs, sizes = [], [], []
        pages: list[Page] = []
        held = [(np.asarray(ids) != rp.desc.null_block).tolist() for ids in block_ids]
        c = rp.coordinator
        storable = c.storable_tokens(num_computed, held)
        if storable < c.cacheable_tokens(num_computed):
            self.calls.saves_cut += 1
        chosen: list[list[int]] = []
        for g, mask in enumerate(c.store_masks(num_computed, held)):
            first = stored_tokens // c.groups[g].block_size
            blocks = [
                i
                for i, m in enumerate(mask)
                if m and first <= i < len(hashes[g]) and i < len(block_ids[g])
            ]
            chosen.append(blocks)
            for layer, b, key in rp.keys(hashes, g, blocks):
                ptr, size = rp.page(layer, int(block_ids[g][b]))
                keys.append(key)
                ptrs.append(ptr)
                sizes.append(size)
                pages.append(Page(key, ptr, size, layer, g, int(block_ids[g][b])))
        tail = num_computed % c.lcm_block_size if self._tails(rp) else 0
        at = num_computed // c.lcm_block_size
        # The tail follows the chain only when every full block before it is stored.
        if tail and storable == num_computed - tail and all(at < len(h) and h[at] for h in held):
            start = num_computed - tail
            name = rp.tail_names(hashes, token_ids, start, num_computed, extra_keys)[-1:]
            for g in range(len(block_ids)):
                chosen[g].append(at)
                for layer, key in rp.tail_keys(g, name):
                    ptr, size = rp.page(layer, int(block_ids[g][at]))
                    keys.append(key)
                    ptrs.append(ptr)
                    sizes.append(size)
                    pages.append(Page(key, ptr, size, layer, g, int(block_ids[g][at])))
            storable = num_computed
        call = self._begin("save", request, rank, storable, 0, chosen, block_ids, started)
        res = await self.client.put_from_async(keys, ptrs, sizes)
        if res.late is None:
            sample = set(drawn(keys, self.digest.value))
            stored = [pages[i] for i in res.stored if i in sample]
            await store_digests(self.client, rp.memory, stored, self.digests)
        pending = self._end(call, res.late)
        self.calls.saves += 1
        return SaveOutcome(
            len(res.stored),
            len(res.skipped),
            len(res.backpressure),
            len(res.failed),
            res.bytes_put,
            pending,
        )

    async def load(
        self,
        rank: int,
        token_ids: Sequence[int],
        block_ids: Sequence[np.ndarray],
        hit_tokens: int,
        extra_keys: Sequence[KeyRun] = (),
        held_tokens: int = 0,
        request: str = "",
    ) -> LoadOutcome:
        """Load what a hit of ``hit_tokens`` needs into ``block_ids``, less what the engine's
        own cache hit of ``held_tokens`` holds; failed blocks by id. A needed block mapped to
        the null block is refused, with nothing written (the engine recomputes)."""
        started = time.time()
        rp = self._rank(rank)
        hashes = rp.group_hashes(token_ids, extra_keys)
        null = rp.desc.null_block
        entries: list[tuple[int, int]] = []
        layers: list[int] = []
        keys, ptrs, sizes = [], [], []
        local = 0
        chosen: list[list[int]] = []
        bs = rp.coordinator.lcm_block_size
        tail = hit_tokens % bs if self._tails(rp) else 0
        full = hit_tokens - tail
        whole = rp.coordinator.load_masks(full)
        for g, mask in enumerate(rp.coordinator.load_masks(full, held_tokens)):
            local += sum(whole[g]) - sum(mask)
            blocks = [i for i, m in enumerate(mask) if m and i < len(block_ids[g])]
            chosen.append(blocks)
            if any(int(block_ids[g][b]) == null for b in blocks):
                raise ConfigError(
                    f"rank {rank}: a load of {hit_tokens} tokens needs blocks {blocks} of group "
                    f"{g}, but the engine gave the null block {null} for one of them; nothing "
                    "was loaded"
                )
            for layer, b, key in rp.keys(hashes, g, blocks):
                ptr, size = rp.page(layer, int(block_ids[g][b]))
                entries.append((g, int(block_ids[g][b])))
                layers.append(layer)
                keys.append(key)
                ptrs.append(ptr)
                sizes.append(size)
        if tail:
            name = rp.tail_names(hashes, token_ids, full, hit_tokens, extra_keys)[-1:]
            at = full // bs
            for g in range(len(block_ids)):
                if at >= len(block_ids[g]) or int(block_ids[g][at]) == null:
                    raise ConfigError(
                        f"rank {rank}: a load of {hit_tokens} tokens ends inside block {at} of "
                        f"group {g}, which the engine did not give a block of its own; nothing "
                        "was loaded"
                    )
                chosen[g].append(at)
                for layer, key in rp.tail_keys(g, name):
                    ptr, size = rp.page(layer, int(block_ids[g][at]))
                    entries.append((g, int(block_ids[g][at])))
                    layers.append(layer)
                    keys.append(key)
                    ptrs.append(ptr)
                    sizes.append(size)
        call = self._begin(
            "load", request, rank, hit_tokens, held_tokens, chosen, block_ids, started
        )
        res = await self.client.get_into_async(keys, ptrs, sizes)
        mismatches: list[DigestMismatch] = []
        if res.late is None and res.loaded:
            sample = set(drawn(keys, self.digest.value))
            landed = [
                Page(keys[i], ptrs[i], sizes[i], layers[i], *entries[i])
                for i in res.loaded
                if i in sample
            ]
            kinds = [str(gr.kind) for gr in rp.desc.groups]
            mismatches = await check_digests(self.client, rp.memory, landed, self.digests, kinds)
        pending = self._end(call, res.late)
        failed: list[set[int]] = [set() for _ in block_ids]
        for i in res.failed:
            g, block = entries[i]
            failed[g].add(block)
        for m in mismatches:
            failed[m.group].add(m.block)
        self.calls.loads += 1
        self.calls.keys += len(res.loaded)
        self.calls.bytes += res.bytes_got
        self.calls.local_blocks += local
        return LoadOutcome(
            len(res.loaded) - len(mismatches),
            res.bytes_got,
            [sorted(f) for f in failed],
            pending,
            tuple(mismatches),
        )

    def _begin(
        self,
        kind: Literal["save", "load"],
        request: str,
        rank: int,
        tokens: int,
        held_tokens: int,
        blocks: list[list[int]],
        block_ids: Sequence[np.ndarray],
        started: float,
    ) -> tuple[int, PoolCall]:
        """Register a call about to reach the store: an engine's poll sees it from now on."""
        table = [[int(b) for b in ids] for ids in block_ids]
        call = PoolCall(
            kind, request, rank, tokens, held_tokens, blocks, table, started, None, "running"
        )
        return self.running.begin(kind, rank, request, call), call

    def _end(
        self,
        begun: tuple[int, PoolCall],
        late: concurrent.futures.Future[Any] | None,
    ) -> bool:
        """The store answered, or its call went late (True: the engine is answered pending);
        either way the call is in ``recent`` once the store returned."""
        call_id, call = begun
        state: Literal["done", "late"] = "done" if late is None else "late"

        def returned() -> None:
            # On the store's thread for a late call: deque.append is atomic.
            self.recent.append(dataclasses.replace(call, ended_at=time.time(), state=state))

        return self.running.end(call_id, late, returned)

    def recent_calls(self) -> list[PoolCall]:
        """``recent``, then the calls whose store call has not returned yet."""
        return [*self.recent, *(c.detail for c in self.running.calls())]
