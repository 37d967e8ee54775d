"""The scheduler's side of the KV pool: lookups, the loads and stores it queues for the workers.

A request that is neither a remote prefill nor a remote decode (and a prefill before it
computes) first asks the sidecar's pool for the longest prefix hit, off the scheduler loop
(``PoolLookups``), and loads it asynchronously; a finished request's computed tokens are stored
before its blocks go back to vLLM. Every block is named by its tokens and vLLM's own extra keys
(``pool_keys``); a request the pool cannot name goes without it, reported through ``skip``.

Stores while a request runs (issue 54). A sliding window's blocks behind the window and a
Mamba state's older blocks (``align`` mode) leave the request's table while it runs: vLLM's
``remove_skipped_blocks``, at each step's ``allocate_slots`` (and again before
``request_finished``), replaces them with the null block and frees them. So at the end the
window tail or the state a resume at the request's end reads is mostly gone, and the store
at ``request_finished`` files almost nothing for these models. Instead, on a model with such
a group, each step's metadata carries a store of the longest prefix whose every needed block
is in the table then (``PoolCoordinator.storable_tokens``), once every ``save_every`` lcm
boundaries:

* When: ``build_connector_meta`` of step s runs after step s's allocation (and frees) and
  before its forward; it knows the tokens computed by the end of step s (computed before the
  step plus scheduled, capped at the token ids known: a draft or an in-flight token is never
  named). The worker runs the step's pool jobs after that step's forward (``wait_for_save``),
  so the KV of every such token is final when the store reads it, and nothing this request
  computes later writes these blocks (a window block is never written again; a Mamba state
  block at a boundary is copied into the next one, not updated in place).
* Held until read: the next step's ``allocate_slots`` may free them, and a freed block goes
  back to vLLM's free queue -- without a block hash to its *front*, reused first -- so another
  request allocated in that very step could write it during the forward while the pool thread
  still reads it. So the store pins what it reads (``BlockPool.touch``: a reference of its
  own; vLLM's free then only drops the request's) and lets go once every worker reported the
  store ended (``PoolSavesDone`` through ``kv_connector_worker_meta``, as vLLM's own CPU
  offload does): a preemption or the request's end cannot hand them out either.
* Once: each store skips the blocks ending at or before what the request stored already
  (``PoolJob.stored``); a later boundary needs no earlier block that the earlier one did not.
  The store at ``request_finished`` still runs for what came after the last boundary stored,
  and is left out when no block is full past it (its call would store nothing: at the end a
  window's blocks are given back already, so the running stores filed what there is).
* A store that failed on a rank leaves no hole the later ones skip: that rank's next store of
  the request starts from the failed one's floor (``pool.PoolJobs``), so every store pins all
  the request's blocks it may read from the start, not only those past the last store.

Full-attention-only models skip these stores: every block stays in the table until the end.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.request import RequestStatus

from app.connectors.vllm.config import ConnectorConfig
from app.connectors.vllm.lookups import PoolLookups
from app.connectors.vllm.metadata import BlockIds, PoolJob
from app.connectors.vllm.pool import running_save_id
from app.connectors.vllm.pool_keys import SKIP_UNKEYABLE, hash_block_size, key_runs, without_keys
from app.store.coordinator import PoolCoordinator, PoolGroup
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
        # Stores while requests run (module docstring): None on a model that needs none.
        self.coordinator = _running_coordinator(kv_cache_config) if config.pool else None
        self._manager: Any = None  # vLLM's KVCacheManager, bound once the scheduler has one
        self._running: dict[str, tuple[Any, bool]] = {}  # request id -> (request, answer)
        self._stored: dict[str, int] = {}  # request id -> tokens its running stores stored
        self._pins: dict[str, tuple[list[Any], int]] = {}  # save id -> (blocks, workers done)
        self._workers = config.tp_size * config.pp_size

    def bind(self, manager: Any) -> None:
        self._manager = manager

    def answers(self, params: dict[str, Any]) -> bool:
        """Whether a request's generated tokens are stored too: on an engine storing its
        answers, except a prefill's (decode computes and stores those)."""
        return self.config.save_answers and not params.get("do_remote_decode")

    def track(self, request: Any, params: dict[str, Any]) -> None:
        """A request whose blocks are allocated (``params``: its ``kv_transfer_params``):
        stored as it runs. A remote prefill's is decode's answer: only if answers are."""
        remote = bool(params.get("do_remote_prefill"))
        if self.coordinator is None or self.config.save_every < 1 or without_keys(request):
            return
        if not remote or self.config.save_answers:
            self._running[request.request_id] = (request, self.answers(params))

    def step(self, scheduled: Mapping[str, int], computed: Mapping[str, int]) -> list[PoolJob]:
        """Stores of what running requests hold by the end of this step (module docstring)."""
        c, manager = self.coordinator, self._manager
        if c is None or manager is None:
            return []
        null = manager.block_pool.null_block.block_id
        jobs = []
        for rid, n in scheduled.items():
            tracked = self._running.get(rid)
            if tracked is None or rid not in computed:
                continue
            request, answer = tracked
            known = request.all_token_ids if answer else request.prompt_token_ids
            end = min(int(computed[rid]) + int(n), len(known))
            last = self._stored.get(rid, 0)
            lcm = c.lcm_block_size
            if end // lcm - last // lcm < self.config.save_every:
                continue
            ids = [list(map(int, g)) for g in manager.get_block_ids(rid)]
            upto = c.storable_tokens(end, [[b != null for b in g] for g in ids])
            if upto <= last:
                continue
            runs = self._key_runs(request, upto)
            if runs is None:
                continue
            sid = running_save_id(rid, upto)
            self._pins[sid] = (self._pin(rid, upto), 0)
            self._stored[rid] = upto
            tokens = list(known[:upto])
            jobs.append(PoolJob(sid, tokens, ids, upto, key_runs=runs, stored=last, running=True))
        return jobs

    def _pin(self, rid: str, upto: int) -> list[Any]:
        """Take a reference on every block a store of the first ``upto`` tokens may read
        (EAGLE's look-ahead block after ``upto`` included), those before the last store too:
        a rank whose earlier store failed stores from its floor again (module docstring)."""
        c = self.coordinator
        assert c is not None
        blocks = self._manager.get_blocks(rid).blocks
        pins = [
            b
            for g, mask in enumerate(c.store_masks(upto))
            for i, b in enumerate(blocks[g][: len(mask) + 1])
            if (i == len(mask) or mask[i]) and not b.is_null
        ]
        self._manager.block_pool.touch(pins)
        return pins

    def saves_done(self, meta: Any) -> None:
        """Workers' reports of ended running stores: a store's blocks go back once all have."""
        for sid, n in getattr(meta, "saves", {}).items():
            entry = self._pins.get(sid)
            if entry is None:
                continue
            blocks, done = entry[0], entry[1] + int(n)
            if done < self._workers:
                self._pins[sid] = (blocks, done)
                continue
            del self._pins[sid]
            self._manager.block_pool.free_blocks(blocks)

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
        stored = self._stored.pop(request.request_id, 0)
        if not self.config.pool or request.status == RequestStatus.FINISHED_ABORTED:
            return False
        if without_keys(request) is not None:
            return False  # counted when the request was first seen
        known = request.all_token_ids if answer else request.prompt_token_ids
        tokens = min(int(request.num_computed_tokens), len(known))
        if tokens <= stored or not any(block_ids):
            return False
        c = self.coordinator
        if stored and c is not None and tokens - stored < min(g.block_size for g in c.groups):
            return False  # no block of any group full past what the running stores stored
        runs = self._key_runs(request, tokens)
        if runs is None:
            return False
        rid = request.request_id
        ids = [list(map(int, g)) for g in block_ids]
        job = PoolJob(rid, list(known[:tokens]), ids, tokens, key_runs=runs, stored=stored)
        self._saves.append(job)
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
        return bool(self._unfinished or self._pins)

    def forget(self, rid: str) -> None:
        """The request finished: its hit and failure are no longer needed (what it stored
        while it ran, ``save`` takes)."""
        self._running.pop(rid, None)
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


def _running_coordinator(kv_cache_config: Any) -> PoolCoordinator | None:
    """The sidecar's coordinator for this engine's groups, where a group gives blocks back
    while a request runs (a window, a chunk, a Mamba state); None where none does."""
    groups = []
    for g in getattr(kv_cache_config, "kv_cache_groups", ()):
        spec = g.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = spec.first_spec
        bs = int(spec.block_size)
        if isinstance(spec, MLAAttentionSpec):
            groups.append(PoolGroup("mla", bs))
        elif isinstance(spec, SlidingWindowSpec):
            groups.append(PoolGroup("sliding_window", bs, sliding_window=spec.sliding_window))
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            return None  # the registration refuses it: no pool
        elif isinstance(spec, FullAttentionSpec):
            groups.append(PoolGroup("full_attention", bs))
        elif isinstance(spec, MambaSpec):
            groups.append(PoolGroup("mamba", bs))
        else:
            return None  # a group the pool does not serve: the registration refuses it
    if not groups or all(g.is_full for g in groups):
        return None
    return PoolCoordinator(groups)
