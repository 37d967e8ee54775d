"""Shared fixtures for the KV pool tests: a real mooncake_master on loopback and clients."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import mooncake.store  # noqa: F401  (a dev dependency: missing means failing, never skipping)
import numpy as np
import pytest

from app.store.master import MasterProcess, start_master, stop_master
from app.store.pool import PoolClient
from app.store.pool_api import PoolConfig
from app.store.service import PoolService

MiB = 1 << 20


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MasterProcess]:
    """One master per test module (most tests only add keys)."""
    log = tmp_path_factory.mktemp("master") / "master.log"
    proc = start_master(0, log_path=log, ready_timeout_s=10.0)
    yield proc
    stop_master(proc, timeout_s=5.0, graceful=False)


@pytest.fixture
def fresh_master(tmp_path: Path) -> Iterator[MasterProcess]:
    """A master of its own, for tests that fill or kill it."""
    proc = start_master(0, log_path=tmp_path / "master.log", ready_timeout_s=10.0)
    yield proc
    stop_master(proc, timeout_s=5.0, graceful=False)


@pytest.fixture(scope="module")
def client(master: MasterProcess) -> Iterator[PoolClient]:
    """A started client on the module's master (64 MiB contributed, 5 s call timeout)."""
    c = PoolClient(PoolConfig(master_address=master.rpc_address, global_segment_size=64 * MiB))
    asyncio.run(c.start_async())
    yield c
    asyncio.run(c.close_async())


@pytest.fixture
def make_client() -> Iterator[Callable[..., Awaitable[PoolClient]]]:
    """Build started clients (awaited) from PoolConfig keyword arguments; all are closed
    afterwards."""
    made: list[PoolClient] = []

    async def make(**kwargs: object) -> PoolClient:
        c = PoolClient(PoolConfig(**kwargs))  # type: ignore[arg-type]
        await c.start_async()
        made.append(c)
        return c

    yield make
    for c in made:
        asyncio.run(c.close_async())


@pytest.fixture
def blocks() -> Callable[[int, int], np.ndarray]:
    """Random bytes shaped (num_blocks, block_bytes), C-contiguous."""
    rng = np.random.default_rng(1234)

    def make(num_blocks: int, block_bytes: int) -> np.ndarray:
        return rng.integers(0, 256, size=(num_blocks, block_bytes), dtype=np.uint8)

    return make


@pytest.fixture
def service(master: MasterProcess) -> Iterator[PoolService]:
    """A pool service (tails on) on the module's master: rank pools register with it."""
    svc = PoolService(
        PoolConfig(master_address=master.rpc_address, global_segment_size=64 * MiB), tails=True
    )
    asyncio.run(svc.start())
    yield svc
    asyncio.run(svc.stop())
