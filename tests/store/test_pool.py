"""Pool client against a real mooncake_master on loopback, plus a scripted store for edges."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import pytest

from app.errors import PoolError
from app.store.hashing import hash_blocks
from app.store.keys import KeyPrefix, block_keys
from app.store.master import MasterProcess, free_port
from app.store.pool import PoolClient
from app.store.pool_api import (
    LEASE_EXPIRED,
    NO_AVAILABLE_HANDLE,
    OBJECT_NOT_FOUND,
    GetResult,
    PoolConfig,
    PutResult,
)

from .conftest import MiB

REPO_ROOT = Path(__file__).resolve().parents[2]
PREFIX = KeyPrefix("test-model", "bfloat16", "HND", "rep")
BLOCK = 64 * 1024


def keys_for(tag: str, n: int, group: int = 0) -> list[str]:
    # Distinct token streams per test, so tests sharing a master never see each other's keys.
    tokens = [hash(tag) % 50_000 + i for i in range(n * 16)]
    return block_keys(PREFIX, group, hash_blocks(tokens, 16, extra_keys=(tag,)))


def ptrs_of(arr: np.ndarray) -> list[int]:
    return [arr.ctypes.data + i * arr.shape[1] for i in range(arr.shape[0])]


# ------------------------------------------------------------------ real master


async def test_put_exists_get_round_trip_is_byte_exact(
    client: PoolClient, blocks: Callable[[int, int], np.ndarray]
) -> None:
    src = blocks(8, BLOCK)
    dst = np.zeros_like(src)
    await client.register_async(src.ctypes.data, src.nbytes)
    await client.register_async(dst.ctypes.data, dst.nbytes)
    keys = keys_for("round-trip", 8)
    before = client.counters()

    assert await client.exists_async(keys) == [False] * 8
    put = await client.put_from_async(keys, ptrs_of(src), [BLOCK] * 8)
    assert put.stored == tuple(range(8)) and put.complete
    assert put.bytes_put == 8 * BLOCK
    assert await client.exists_async(keys) == [True] * 8

    got = await client.get_into_async(keys, ptrs_of(dst), [BLOCK] * 8)
    assert got.ok and got.loaded == tuple(range(8))
    assert np.array_equal(src, dst)

    after = client.counters()
    assert after.keys_put - before.keys_put == 8
    assert after.bytes_put - before.bytes_put == 8 * BLOCK
    assert after.bytes_got - before.bytes_got == 8 * BLOCK
    assert after.hits - before.hits == 8 and after.misses - before.misses == 8


async def test_existing_keys_are_skipped(
    client: PoolClient, blocks: Callable[[int, int], np.ndarray]
) -> None:
    first = blocks(4, BLOCK)
    second = blocks(8, BLOCK)
    keys = keys_for("skip", 8)
    assert (await client.put_from_async(keys[:4], ptrs_of(first), [BLOCK] * 4)).stored == (
        0,
        1,
        2,
        3,
    )
    before = client.counters()
    put = await client.put_from_async(keys, ptrs_of(second), [BLOCK] * 8)
    assert put.skipped == (0, 1, 2, 3)
    assert put.stored == (4, 5, 6, 7)
    assert client.counters().keys_skipped - before.keys_skipped == 4
    # The pool kept the first bytes for the skipped keys.
    dst = np.zeros((1, BLOCK), dtype=np.uint8)
    assert (await client.get_into_async(keys[:1], ptrs_of(dst), [BLOCK])).ok
    assert np.array_equal(dst[0], first[0])


async def test_missing_keys_are_reported_by_index_and_empty_calls_finish_at_once(
    client: PoolClient, blocks: Callable[[int, int], np.ndarray]
) -> None:
    src = blocks(2, BLOCK)
    keys = keys_for("missing", 3)
    await client.put_from_async([keys[0], keys[2]], ptrs_of(src), [BLOCK] * 2)
    dst = np.zeros((3, BLOCK), dtype=np.uint8)
    got = await client.get_into_async(keys, ptrs_of(dst), [BLOCK] * 3)
    assert got.loaded == (0, 2) and got.failed == (1,)
    assert got.codes[1] == OBJECT_NOT_FOUND
    assert np.array_equal(dst[2], src[1])

    t0 = time.monotonic()
    assert await client.get_into_async([], [], []) == GetResult()
    assert await client.put_from_async([], [], []) == PutResult()
    assert await client.exists_async([]) == []
    assert time.monotonic() - t0 < 0.5  # no store call at all; generous for a loaded box


async def test_async_wrappers(client: PoolClient, blocks: Callable[[int, int], np.ndarray]) -> None:
    src = blocks(3, BLOCK)
    dst = np.zeros_like(src)
    keys = keys_for("async", 3)
    put = await client.put_from_async(keys, ptrs_of(src), [BLOCK] * 3)
    assert put.stored == (0, 1, 2)
    assert await client.exists_async(keys) == [True] * 3
    got = await client.get_into_async(keys, ptrs_of(dst), [BLOCK] * 3)
    assert got.ok and np.array_equal(src, dst)
    assert await client.get_into_async([], [], []) == GetResult()


async def test_full_pool_is_backpressure_not_an_error(
    fresh_master: MasterProcess,
    make_client: Callable[..., Awaitable[PoolClient]],
    blocks: Callable[[int, int], np.ndarray],
) -> None:
    # The only segment is this client's 16 MiB (Mooncake's minimum); offer 32 MiB in 1 MiB
    # objects, 4 keys per put call.
    pool = await make_client(
        master_address=fresh_master.rpc_address,
        global_segment_size=16 * MiB,
        max_batch_keys=4,
        timeout_s=5.0,
    )
    src = blocks(32, MiB)
    keys = keys_for("full", 32)
    t0 = time.monotonic()
    put = await pool.put_from_async(keys, ptrs_of(src), [MiB] * 32)
    assert time.monotonic() - t0 < 5.0
    assert put.backpressure, put
    assert not put.failed and not put.timed_out
    assert 0 < len(put.stored) < 32
    assert sorted(put.stored + put.backpressure) == list(range(32))
    # After the first "no space" the rest of the request was not even sent.
    first_full = min(put.backpressure)
    assert put.backpressure == tuple(range(first_full, 32))
    assert pool.counters().backpressure == len(put.backpressure)
    assert not any(await pool.exists_async([keys[i] for i in put.backpressure]))


def test_killed_master_ends_in_counted_failures_within_the_timeout(tmp_path: Path) -> None:
    # In a process of its own: see killed_master_scenario.py for why.
    timeout = 1.0
    t0 = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.store.killed_master_scenario",
            str(tmp_path / "m.log"),
            str(timeout),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert time.monotonic() - t0 < 30
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["put_before"] == [0, 1]
    calls = report["calls"]
    slack = 2.0
    for call in calls:
        assert call["seconds"] < timeout + slack, call
    by_name = [c["call"] for c in calls]
    assert by_name == ["exists", "exists", "get_into", "put_from", "close"]
    assert calls[0]["result"] == [False, False] and calls[1]["result"] == [False, False]
    assert calls[2]["result"] == [0, 1]  # both blocks must be recomputed
    assert calls[3]["result"] == [0]
    assert report["failures"] >= 5
    assert report["timeouts"] >= 1


async def test_start_without_a_master_fails_fast_with_pool_error() -> None:
    dead = f"127.0.0.1:{free_port()}"
    client = PoolClient(PoolConfig(master_address=dead, setup_timeout_s=2.0))
    t0 = time.monotonic()
    with pytest.raises(PoolError, match="no Mooncake master reachable"):
        await client.start_async()
    assert time.monotonic() - t0 < 2.0
    assert not client.started
    with pytest.raises(PoolError, match="not started"):
        await client.exists_async(["k"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"master_address": "nohostport"}, "host:port"),
        ({"master_address": "127.0.0.1:1", "global_segment_size": MiB}, "16 MiB"),
        ({"master_address": "127.0.0.1:1", "protocol": "udp"}, "protocol"),
        ({"master_address": "127.0.0.1:1", "timeout_s": 0}, "timeout_s"),
    ],
)
def test_bad_config_is_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(PoolError, match=match):
        PoolConfig(**kwargs)


# ------------------------------------------------------------------ scripted store


class ScriptedStore:
    """A stand-in for MooncakeDistributedStore whose answers the test decides."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.put_calls: list[list[str]] = []
        self.capacity = 1 << 30
        self.get_script: list[list[int]] = []
        self.block = threading.Event()
        self.block.set()

    def setup(self, *args: object) -> int:
        return 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self.block.wait()
        return [1 if k in self.data else 0 for k in keys]

    def register_buffer(self, ptr: int, size: int) -> int:
        return 0

    def batch_put_from(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        self.put_calls.append(list(keys))
        out = []
        for k, size in zip(keys, sizes, strict=True):
            if len(self.data) >= self.capacity:
                out.append(NO_AVAILABLE_HANDLE)
            else:
                self.data[k] = b"x" * size
                out.append(0)
        return out

    def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        self.block.wait()
        if self.get_script:
            return self.get_script.pop(0)
        return [len(self.data[k]) if k in self.data else OBJECT_NOT_FOUND for k in keys]

    def upsert_batch(self, keys: list[str], values: list[bytes]) -> int:
        self.data.update(zip(keys, values, strict=True))
        return 0

    def get_batch(self, keys: list[str]) -> list[bytes]:
        return [self.data.get(k, b"") for k in keys]

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        return [0 if self.data.pop(k, None) is not None else OBJECT_NOT_FOUND for k in keys]

    def close(self) -> int:
        return 0


async def scripted_client(store: ScriptedStore, **kwargs: object) -> PoolClient:
    client = PoolClient(
        PoolConfig(master_address="127.0.0.1:1", **kwargs),  # type: ignore[arg-type]
        store_factory=lambda: store,
    )
    client._probe_master = lambda: None  # type: ignore[method-assign]
    await client.start_async()
    return client


async def test_after_no_space_the_rest_of_the_request_is_not_sent() -> None:
    store = ScriptedStore()
    store.capacity = 5
    client = await scripted_client(store, max_batch_keys=2)
    keys = [f"k{i}" for i in range(10)]
    put = await client.put_from_async(keys, [1] * 10, [8] * 10)
    assert put.stored == (0, 1, 2, 3, 4)
    assert put.backpressure == (5, 6, 7, 8, 9)
    # Chunks [0,1] [2,3] [4,5] were sent; [6,7] and [8,9] were not.
    assert store.put_calls == [["k0", "k1"], ["k2", "k3"], ["k4", "k5"]]
    assert client.counters().backpressure == 5
    await client.close_async()


async def test_lease_expired_is_asked_again_and_short_reads_fail() -> None:
    store = ScriptedStore()
    client = await scripted_client(store)
    store.get_script = [[8, LEASE_EXPIRED, 4], [8]]
    got = await client.get_into_async(["a", "b", "c"], [1, 2, 3], [8, 8, 8])
    assert got.loaded == (0, 1)
    assert got.failed == (2,)  # 4 of 8 bytes is no block
    await client.close_async()


async def test_a_hung_call_times_out_and_quiesce_waits_for_it() -> None:
    store = ScriptedStore()
    client = await scripted_client(store, timeout_s=0.3, max_workers=1)
    store.data["a"] = b"x" * 8
    store.block.clear()
    t0 = time.monotonic()
    got = await client.get_into_async(["a"], [1], [8])
    assert got.timed_out and got.failed == (0,)
    assert await client.exists_async(["a"]) == [
        False
    ]  # queued behind the hung call, gives up in time
    assert time.monotonic() - t0 < 2.0
    assert client.counters().timeouts == 2
    assert not client.quiesce(0.05)
    store.block.set()
    assert client.quiesce(2.0)
    assert await client.exists_async(["a"]) == [True]
    await client.close_async()
