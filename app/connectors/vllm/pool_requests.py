"""The scheduler's side of the KV pool: lookups, the loads and stores it queues for the workers.

A request that is neither a remote prefill nor a remote decode (and a prefill before it
computes) first asks the sidecar's pool for the longest prefix hit, off the scheduler loop
(``PoolLookups``), and loads it asynchronously; a finished request's computed tokens are stored
before its blocks go back to vLLM. Every block is named by its tokens and vLLM's own extra keys
(``pool_keys``); a request the pool cannot name goes without it, reported through ``skip``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm.v1.request import RequestStatus

from app.connectors.vllm.config import ConnectorConfig
from app.connectors.vllm.lookups import PoolLookups
from app.connectors.vllm.metadata import BlockIds, PoolJob
from app.connectors.vllm.pool_keys import SKIP_UNKEYABLE, hash_block_size, key_runs, without_keys
from app.store.hashing import KeyRun

# (request id, reason, what it goes without): the scheduler counts it once a request.
SkipHook = Callable[[str, str, str], None]


class PoolRequests:
    def __init__(self, config: ConnectorConfig, kv_cache_config: Any, skip: SkipHook) -> None:
        self.config = config
        self.lookups = PoolLookups(config) if config.pool else None
        self.hash_block_size = hash_block_size(kv_cache_config) if kv_cache_config else 1
        self._skip = skip
        # (pool hit, tokens the engine's own cache holds) by request: the load fetches between
        self._hits: dict[str, tuple[int, int]] = {}
        self._loads: list[PoolJob] = []
        self._saves: list[PoolJob] = []
        self._unfinished: set[str] = set()  # kept blocks, being stored
        # Requests whose pool load failed: vLLM recomputes them, and asking the pool again
        # would find the same keys (a dead sidecar's segment stays listed until the master
        # drops it) and fail the same way, once a step, for as long as that takes.
        self._failed: set[str] = set()

    def hit(self, request: Any, num_computed: int) -> tuple[int | None, bool]:
        """Tokens the KV pool serves beyond what vLLM has (None while the lookup runs: vLLM
        asks again next step); at least the last prompt token is left to compute (vLLM needs
        its logits)."""
        rid = request.request_id
        self._hits.pop(rid, None)
        if self.lookups is None or rid in self._failed:
            return 0, False
        if request.skip_reading_prefix_cache:
            # As vLLM's own cache: the client asked for every prompt token computed (e.g.
            # prompt logprobs); the computed blocks are still stored at the end.
            return 0, False
        # The whole prompt: the sidecar caps the hit at one token short of it, as vLLM does.
        tokens = request.prompt_token_ids
        runs = self._key_runs(request, len(tokens))
        if runs is None:
            return 0, False
        hit = self.lookups.hit(rid, tokens, runs)
        if hit is None:
            return None, False
        if hit <= num_computed:
            return 0, False
        self._hits[rid] = (hit, num_computed)
        return hit - num_computed, True

    def allocated(self, request: Any, ids: BlockIds, num_external: int) -> None:
        """vLLM allocated the request's blocks: queue the load of its hit, if it has one."""
        pool_hit = self._hits.pop(request.request_id, None)
        if pool_hit is None or num_external <= 0:
            return
        hit, held = pool_hit
        runs = self._key_runs(request, hit)
        assert runs is not None  # the lookup keyed the same request
        tokens = list(request.prompt_token_ids[:hit])
        self._loads.append(PoolJob(request.request_id, tokens, ids, hit, held=held, key_runs=runs))

    def save(self, request: Any, block_ids: tuple[list[int], ...], *, answer: bool = False) -> bool:
        """Queue the computed prompt (``answer``: and the generated tokens whose KV is
        computed) for the pool; True when the blocks must stay until then."""
        if not self.config.pool or request.status == RequestStatus.FINISHED_ABORTED:
            return False
        if without_keys(request) is not None:
            return False  # counted when the request was first seen
        known = request.all_token_ids if answer else request.prompt_token_ids
        tokens = min(int(request.num_computed_tokens), len(known))
        if tokens < 1 or not any(block_ids):
            return False
        runs = self._key_runs(request, tokens)
        if runs is None:
            return False
        rid = request.request_id
        ids = [list(map(int, g)) for g in block_ids]
        self._saves.append(PoolJob(rid, list(known[:tokens]), ids, tokens, key_runs=runs))
        self._unfinished.add(rid)
        return True

    def take(self) -> tuple[list[PoolJob], list[PoolJob]]:
        """The loads and stores queued since the last step, for this step's metadata."""
        out = (self._loads, self._saves)
        self._loads, self._saves = [], []
        return out

    def load_failed(self, rid: str) -> None:
        if self.lookups is not None:
            self._failed.add(rid)

    def saved(self, rid: str) -> None:
        self._unfinished.discard(rid)

    @property
    def saving(self) -> bool:
        return bool(self._unfinished)

    def forget(self, rid: str) -> None:
        """The request finished: its hit and failure are no longer needed."""
        self._hits.pop(rid, None)
        self._failed.discard(rid)
        if self.lookups is not None:
            self.lookups.forget(rid)

    def close(self) -> None:
        if self.lookups is not None:
            self.lookups.close()

    def _key_runs(self, request: Any, num_tokens: int) -> list[KeyRun] | None:
        """vLLM's extra keys of the request's blocks (None: it cannot be keyed, and goes
        without the pool)."""
        runs = key_runs(request, num_tokens, self.hash_block_size)
        if runs is None:
            self._skip(request.request_id, SKIP_UNKEYABLE, "no KV pool")
        return runs
