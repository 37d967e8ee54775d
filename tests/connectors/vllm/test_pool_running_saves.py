"""Stores while a request runs (issue 54), on vLLM's own ``KVCacheManager`` and ``Request``.

A sliding-window model's blocks behind the window leave the request's table as it runs; the
scheduler's pool side stores each block boundary while its window tail is still held, pins
what the store reads so that vLLM cannot hand it to another request before the store ended,
and lets go once every worker reported the store. Prefix caching is off: vLLM then reuses a
freed block first (LIFO), the case where an unpinned block would be overwritten soonest.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

from app.connectors.vllm.config import ConnectorConfig
from app.connectors.vllm.metadata import PoolJob, PoolSavesDone
from app.connectors.vllm.pool_requests import PoolRequests
from tests.connectors.vllm.conftest import Silent

BS = 16
WINDOW = 33  # needs the 2 blocks before a boundary
PROMPT = list(range(1, 41))  # 2 blocks and 8 tokens


def kv_config(*, window: bool = True) -> KVCacheConfig:
    common: dict[str, Any] = {"block_size": BS, "num_kv_heads": 1, "dtype": torch.float32}
    specs: list[Any] = [FullAttentionSpec(head_size=8, **common)]
    if window:
        specs.append(SlidingWindowSpec(head_size=8, sliding_window=WINDOW, **common))
    return KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)],
    )


class Engine:
    """One request through vLLM's cache manager, step by step, as its scheduler drives it."""

    def __init__(self, silent: Silent, save_every: int = 1, window: bool = True) -> None:
        config = kv_config(window=window)
        self.manager = KVCacheManager(
            config,
            max_model_len=1024,
            scheduler_block_size=BS,
            hash_block_size=BS,
            enable_caching=False,
        )
        cc = ConnectorConfig(silent.endpoint, "e", 1, 1, None, 1.0, pool=True, save_answers=True)
        self.pool = PoolRequests(
            ConnectorConfig(**{**cc.__dict__, "save_every": save_every}),
            config,
            lambda *_: None,
        )
        self.pool.bind(self.manager)
        self.request = Request("r", list(PROMPT), SamplingParams(max_tokens=200), None)
        self.jobs: list[PoolJob] = []

    def step(self, n: int) -> list[PoolJob]:
        r = self.request
        assert self.manager.allocate_slots(r, n) is not None
        if r.num_computed_tokens == 0:
            self.pool.track(r, {})
        jobs = self.pool.step({"r": n}, {"r": r.num_computed_tokens})
        r.num_computed_tokens += n
        if r.num_computed_tokens >= r.num_prompt_tokens:
            r.append_output_token_ids(1000 + r.num_computed_tokens)  # sampled after the step
        self.jobs += jobs
        return jobs

    def ref(self, block_id: int) -> int:
        return int(self.manager.block_pool.blocks[block_id].ref_cnt)

    def close(self) -> None:
        self.pool.close()


def test_each_boundary_is_stored_once_as_the_request_crosses_it(silent: Silent) -> None:
    e = Engine(silent)
    try:
        e.step(len(PROMPT))
        for _ in range(60):  # decode: boundaries 48, 64, 80, 96
            e.step(1)
        # Every boundary, in order, each store skipping what the one before stored.
        assert [j.tokens for j in e.jobs] == [32, 48, 64, 80, 96]
        assert [j.stored for j in e.jobs] == [0, 32, 48, 64, 80]
        assert all(j.running and j.req_id == f"r@pool-{j.tokens}" for j in e.jobs)
        for j in e.jobs:
            assert j.token_ids == e.request.all_token_ids[: j.tokens]
            # The window tail before the boundary is in the table the store reads.
            tail = j.block_ids[1][j.tokens // BS - 2 : j.tokens // BS]
            assert 0 not in tail, (j.tokens, j.block_ids[1])
        # No block is full past 96 at the end (100 computed): no store there, nothing kept.
        ids = e.manager.get_block_ids("r")
        assert not e.pool.save(e.request, ids, answer=True)
        assert e.pool.take() == ([], [])
    finally:
        e.close()


def test_a_stored_window_block_stays_pinned_until_every_worker_reported(silent: Silent) -> None:
    e = Engine(silent)
    try:
        (first,) = e.step(len(PROMPT))  # the tail before 32: window blocks 0 and 1
        window_block = first.block_ids[1][0]
        for _ in range(30):  # the window slides past block 0: vLLM frees it
            e.step(1)
        table = e.manager.get_block_ids("r")
        assert table[1][0] == 0  # the null block took its place
        # Not handed out again (freed unpinned, vLLM gives it to the very next allocation).
        assert window_block not in table[0] + table[1]
        assert e.ref(window_block) == 1  # the store's own reference
        e.pool.saves_done(PoolSavesDone({first.req_id: 1}))
        assert e.ref(window_block) == 0  # one worker: released
        assert e.pool.saving  # later stores still pinned
    finally:
        e.close()


def test_two_workers_release_a_store_only_when_both_reported(silent: Silent) -> None:
    e = Engine(silent)
    try:
        e.pool._workers = 2
        (first,) = e.step(len(PROMPT))
        block = first.block_ids[1][0]
        for _ in range(30):
            e.step(1)
        e.pool.saves_done(PoolSavesDone({first.req_id: 1}))
        assert e.ref(block) == 1
        e.pool.saves_done(PoolSavesDone({first.req_id: 1}))
        assert e.ref(block) == 0
    finally:
        e.close()


def test_save_every_k_boundaries(silent: Silent) -> None:
    e = Engine(silent, save_every=2)
    try:
        e.step(len(PROMPT))
        for _ in range(60):
            e.step(1)
        assert [j.tokens for j in e.jobs] == [32, 64, 96]
    finally:
        e.close()


def test_a_full_attention_model_stores_only_at_the_end(silent: Silent) -> None:
    e = Engine(silent, window=False)
    try:
        e.step(len(PROMPT))
        for _ in range(30):
            e.step(1)
        assert e.jobs == []  # every block stays in the table until request_finished
    finally:
        e.close()


def test_the_store_at_the_end_skips_what_the_running_ones_stored(silent: Silent) -> None:
    """Every second boundary: 64 is the last stored at 84 computed, and block 4 (64-80) is
    full past it: the store at the end files it, from 64 on."""
    e = Engine(silent, save_every=2)
    try:
        e.step(len(PROMPT))
        for _ in range(44):
            e.step(1)
        assert [j.tokens for j in e.jobs] == [32, 64]
        assert e.pool.save(e.request, e.manager.get_block_ids("r"), answer=True)
        (_, (final,)) = e.pool.take()
        assert (final.stored, final.tokens) == (64, 84)
    finally:
        e.close()


def test_each_store_pins_the_blocks_before_the_last_store_too(silent: Silent) -> None:
    """A rank whose store at 32 failed stores from 0 again at 48 (``pool.PoolJobs``): the
    store at 48 holds full-attention block 0 after the one at 32 let go."""
    e = Engine(silent)
    try:
        (first,) = e.step(len(PROMPT))
        for _ in range(8):  # 40 -> 48: the second boundary
            e.step(1)
        assert [j.tokens for j in e.jobs] == [32, 48]
        block0 = first.block_ids[0][0]
        e.pool.saves_done(PoolSavesDone({first.req_id: 1}))
        assert e.ref(block0) == 2  # the request's and the store at 48's
        e.pool.saves_done(PoolSavesDone({e.jobs[1].req_id: 1}))
        assert e.ref(block0) == 1
    finally:
        e.close()
