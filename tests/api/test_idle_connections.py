"""Idle TCP connections to the admin port neither fail /livez nor stay open for good."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from app.api import server as api_server
from app.api.server import AdminServer
from tests.api.conftest import in_process_sidecar

pytestmark = pytest.mark.timeout(60)

IDLE = 100
IDLE_TIMEOUT_S = 2


@pytest.fixture
async def admin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[AdminServer]:
    """A sidecar and its admin API in this process, idle connections closed after 2 s."""
    monkeypatch.setattr(api_server, "_IDLE_TIMEOUT_S", IDLE_TIMEOUT_S)
    async with in_process_sidecar("idle-conns", tmp_path) as (_, server):
        yield server


async def open_idle(admin: AdminServer, n: int) -> list[asyncio.StreamWriter]:
    writers = []
    for _ in range(n):
        _, w = await asyncio.open_connection(admin.host, admin.port)
        writers.append(w)
    return writers


async def test_livez_answers_under_many_idle_connections(admin: AdminServer) -> None:
    writers = await open_idle(admin, IDLE)
    try:
        assert admin._server is not None
        state = admin._server.server_state
        deadline = time.monotonic() + 1.0
        while len(state.connections) < IDLE and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert len(state.connections) >= IDLE  # all held open while /livez is asked

        async with httpx.AsyncClient(base_url=admin.url, timeout=5) as client:
            t0 = time.monotonic()
            r = await client.get("/livez")
            took = time.monotonic() - t0
            assert r.status_code == 200, r.text
            assert took < 1.0
            # Other calls count requests in flight, not connections: they answer too.
            assert (await client.get("/v1/status")).status_code == 200
    finally:
        for w in writers:
            w.close()


async def test_idle_connections_are_closed(admin: AdminServer) -> None:
    readers = []
    for _ in range(20):
        r, _ = await asyncio.open_connection(admin.host, admin.port)
        readers.append(r)
    # A connection that never sends a request is closed by the server, as a keep-alive one is.
    t0 = time.monotonic()
    eofs = await asyncio.wait_for(asyncio.gather(*(r.read() for r in readers)), 10)
    assert eofs == [b""] * len(readers)
    assert IDLE_TIMEOUT_S - 0.5 < time.monotonic() - t0 < IDLE_TIMEOUT_S + 3
