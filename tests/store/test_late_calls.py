"""No pool I/O outlives what the engine is told: a get or put past the pool's timeout is
answered pending and its blocks stay the engine's to keep until Mooncake returns.

Unit tests of the bookkeeping with a store whose call blocks on an Event, then the real thing:
a pool segment's holder SIGSTOPped during a save and during a load (real mooncake_master and
Mooncake Store clients on loopback)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from app.kvcache.layout import KVLayout
from app.store.master import MasterProcess
from app.store.pool_api import PoolConfig
from app.store.running import RunningCalls
from app.store.service import PoolService

from .rank_pools import PresetRank, preset_rank
from .test_pool import ScriptedStore, scripted_client

REPO_ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ bookkeeping


async def test_a_call_past_its_timeout_is_handed_back_until_it_returns() -> None:
    store = ScriptedStore()
    client = await scripted_client(store, timeout_s=0.2)
    store.data["a"] = b"x" * 8
    store.block.clear()
    got = await client.get_into_async(["a"], [1], [8])
    assert got.timed_out and got.late is not None and not got.late.done()
    assert client.counters().late_running == 1
    store.block.set()
    got.late.result(timeout=2.0)  # the store's call returns; the result says it ended
    deadline = time.monotonic() + 2.0
    while client.counters().late_running and time.monotonic() < deadline:
        await asyncio.sleep(0.01)  # its done callbacks run just after the waiters wake
    assert client.counters().late_running == 0
    assert client.counters().late_returns == 1
    # A call that never started (queued behind a hung one, cancelled) is not late.
    store.block.clear()
    one = await scripted_client(store, timeout_s=0.2, max_workers=1)
    first, second = await asyncio.gather(
        one.get_into_async(["a"], [1], [8]), one.get_into_async(["a"], [1], [8])
    )
    assert first.late is not None and second.late is None
    store.block.set()
    await client.close_async()
    await one.close_async()


def test_a_late_call_is_running_until_it_returns_and_stuck_past_the_quarantine() -> None:
    import concurrent.futures

    now = [100.0]
    calls = RunningCalls(quarantine_max_s=30.0, clock=lambda: now[0])
    on_time = calls.begin("load", 0, "fast")
    assert calls.running(0, "load", ["fast"]) == ["fast"]  # in flight, even on time
    assert not calls.end(on_time, None)
    assert calls.running(0, "load", ["fast"]) == []
    late: concurrent.futures.Future[None] = concurrent.futures.Future()
    returned: list[bool] = []
    slow = calls.begin("save", 0, "slow")
    assert calls.end(slow, late, lambda: returned.append(True))
    assert calls.running(0, "save", ["slow"]) == ["slow"]
    assert calls.running(0, "load", ["slow"]) == []  # another kind
    assert calls.running(1, "save", ["slow"]) == []  # another rank
    now[0] += 31.0
    assert calls.running(0, "save", ["slow"]) == ["slow"]  # kept past the quarantine
    assert calls.counters.stuck == 1 and not returned
    late.set_result(None)
    assert returned == [True]
    assert calls.running(0, "save", ["slow"]) == []
    assert calls.counters.released == 1 and calls.counters.late_saves == 1


# ------------------------------------------------------------------ a stopped segment holder


@pytest.fixture
def holder(master: MasterProcess) -> Iterator[subprocess.Popen[str]]:
    """The process whose segment holds every object (the service contributes none)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.bench.pool.holder", master.rpc_address, str(64 << 20)],
        cwd=REPO_ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    yield proc
    os.kill(proc.pid, signal.SIGCONT)
    proc.kill()
    proc.wait(10)


@pytest.fixture
def service(master: MasterProcess, holder: subprocess.Popen[str]) -> Iterator[PoolService]:
    svc = PoolService(
        PoolConfig(
            master_address=master.rpc_address,
            global_segment_size=0,
            timeout_s=1.0,
            quarantine_max_s=60.0,
        ),
        tails=True,
    )
    asyncio.run(svc.start())
    yield svc
    assert svc.client.quiesce(40.0)
    asyncio.run(svc.stop())


def _fill(rank: PresetRank, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for buf in rank.layout.buffers:
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=gen))


def _pages(rank: PresetRank, blocks: list[int]) -> bytes:
    return b"".join(
        bytes(np.frombuffer(_at(*rank.pool.page(layer, b)), dtype=np.uint8))
        for layer in sorted(rank.pool.page_bytes)
        for b in blocks
    )


def _at(ptr: int, size: int) -> memoryview:
    import ctypes

    return memoryview((ctypes.c_uint8 * size).from_address(ptr)).cast("B")


async def _poll_until_settled(svc: PoolService, kind: str, request: str, timeout_s: float) -> float:
    start = time.monotonic()
    while svc.running.running(0, kind, [request]):  # type: ignore[arg-type]
        assert time.monotonic() - start < timeout_s, f"{kind} of {request} never settled"
        await asyncio.sleep(0.05)
    return time.monotonic() - start


def test_a_stopped_holder_keeps_a_save_and_a_load_pending_until_it_resumes(
    service: PoolService, holder: subprocess.Popen[str]
) -> None:
    engine = preset_rank("llama-3.1-8b", KVLayout.HNC, True, num_blocks=8)
    _fill(engine, seed=3)
    bs = engine.block_size
    tokens = list(range(4000, 4000 + 2 * bs))
    table = [np.array([2, 5])]
    before = _pages(engine, [2, 5])

    async def run() -> None:
        await service.register(engine.pool)
        # ---- save while the holder is stopped: pending, the blocks stay pinned
        os.kill(holder.pid, signal.SIGSTOP)
        saved = await service.save(0, tokens, table, len(tokens), request="saver")
        assert saved.pending and saved.stored == 0
        assert service.running.running(0, "save", ["saver"]) == ["saver"]
        (shown,) = [c for c in service.recent_calls() if c.request == "saver"]
        assert shown.state == "running" and shown.ended_at is None
        await asyncio.sleep(1.0)
        assert service.running.running(0, "save", ["saver"]) == ["saver"]  # still
        os.kill(holder.pid, signal.SIGCONT)
        await _poll_until_settled(service, "save", "saver", 20.0)
        (shown,) = [c for c in service.recent_calls() if c.request == "saver"]
        assert shown.state == "late" and shown.ended_at is not None
        # What the late put filed is the request's own bytes: read it back elsewhere.
        hit = await service.lookup(0, [*tokens, 1])
        assert hit.hit_tokens == 2 * bs
        reader = preset_rank("llama-3.1-8b", KVLayout.HNC, True, num_blocks=8)
        await service.register(reader.pool)
        out = await service.load(0, [*tokens, 1], [np.array([1, 3])], 2 * bs, request="r")
        assert out.failed_blocks == [[]] and not out.pending
        assert _pages(reader, [1, 3]) == before

        # ---- load while the holder is stopped: pending until the late get returned
        loader = preset_rank("llama-3.1-8b", KVLayout.HNC, True, num_blocks=8)
        await service.register(loader.pool)
        os.kill(holder.pid, signal.SIGSTOP)
        got = await service.load(0, [*tokens, 1], [np.array([4, 6])], 2 * bs, request="loader")
        assert got.pending
        assert service.running.running(0, "load", ["loader"]) == ["loader"]
        untouched = _pages(loader, [4, 6])
        assert untouched != before  # nothing landed yet ...
        os.kill(holder.pid, signal.SIGCONT)
        waited = await _poll_until_settled(service, "load", "loader", 20.0)
        # ... and it does land after the engine was told nothing: the blocks were kept.
        assert _pages(loader, [4, 6]) == before, waited
        counters = service.running.counters
        assert (counters.late_saves, counters.late_loads, counters.released) == (1, 1, 2)
        assert counters.stuck == 0

    asyncio.run(run())
