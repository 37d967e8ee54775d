"""A pool that fills keeps taking new keys (issue 37: a pool under many conversations): the
real mooncake_master evicts older objects once a put finds no room, the refused keys are
counted back-pressure, offered again they are stored, and what the pool holds never exceeds
the memory its clients gave it. Which objects go is the master's choice (it evicts a share of
those whose lease ended), not an LRU this test could rely on.

The master evicts no object whose lease runs (``--default_kv_lease_ttl``, 10 s by default; a
put or a read takes one): with the default, a pool filled within the last 10 s refuses every
new key until then (measured: round 2 of this test waited 10.0 s). The master here runs with
a 300 ms lease so the rounds follow each other."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from app.store.master import MasterProcess, start_master, stop_master
from app.store.pool import PoolClient

from .conftest import MiB
from .test_pool import keys_for, ptrs_of

SEGMENT = 16 * MiB  # Mooncake's minimum; the only segment of this master
ROUNDS, PER_ROUND = 6, 8  # 48 objects of 1 MiB through a 16 MiB pool
LEASE_MS = 300


@pytest.fixture
def short_lease_master(tmp_path: Path) -> Iterator[MasterProcess]:
    proc = start_master(
        0,
        log_path=tmp_path / "master.log",
        extra_args=(f"--default_kv_lease_ttl={LEASE_MS}",),
    )
    yield proc
    stop_master(proc, timeout_s=5.0, graceful=False)


async def test_a_full_pool_evicts_and_keeps_taking_new_keys(
    short_lease_master: MasterProcess,
    make_client: Callable[..., Awaitable[PoolClient]],
    blocks: Callable[[int, int], np.ndarray],
) -> None:
    pool = await make_client(
        master_address=short_lease_master.rpc_address,
        global_segment_size=SEGMENT,
        timeout_s=5.0,
    )
    src = blocks(PER_ROUND, MiB)
    await pool.register_async(src.ctypes.data, src.nbytes)
    ptrs = ptrs_of(src)
    rounds = [keys_for(f"evict-{r}", PER_ROUND) for r in range(ROUNDS)]
    for keys in rounds:
        deadline = time.monotonic() + 10.0
        todo = list(range(PER_ROUND))
        while todo:  # what a full pool refused, offered again as the master evicts
            put = await pool.put_from_async(
                [keys[i] for i in todo], [ptrs[i] for i in todo], [MiB] * len(todo)
            )
            assert not put.failed and not put.timed_out, put
            todo = [todo[i] for i in put.backpressure]
            assert time.monotonic() < deadline, f"{len(todo)} keys still refused after 10 s"
            if todo:
                await asyncio.sleep(0.05)
        held = sum(await pool.exists_async([k for ks in rounds for k in ks]))
        assert held * MiB <= SEGMENT
    per_round = [sum(await pool.exists_async(keys)) for keys in rounds]
    print("held per round", per_round)
    # Every round was stored in full at its turn; the pool holds at most a third of them now.
    assert 0 < sum(per_round) <= SEGMENT // MiB
    assert pool.counters().backpressure > 0
