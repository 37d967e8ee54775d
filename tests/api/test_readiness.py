"""A sidecar in this process, on free ports: 503 until its engine registers, then 200."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from app.api.server import AdminServer
from app.engine_link.client import EngineLink
from app.errors import ConfigError
from app.sim.ranks import CacheParams, SimKV, register_rank
from app.transfer.sidecar.process import Sidecar
from tests.api.conftest import in_process_sidecar

PARAMS = CacheParams("llama-3.1-8b", tp_size=1, block_size=16, num_blocks=8, layers=2)


@pytest.fixture
async def sidecar(tmp_path: Path) -> AsyncIterator[tuple[Sidecar, AdminServer]]:
    async with in_process_sidecar("in-process", tmp_path) as pair:
        yield pair


def _register(endpoint: str) -> tuple[EngineLink, SimKV]:
    link = EngineLink(endpoint, "in-process", 0)
    return link, register_rank(link, PARAMS)


async def test_not_ready_until_the_engine_registers(
    sidecar: tuple[Sidecar, AdminServer],
) -> None:
    sc, admin = sidecar
    async with httpx.AsyncClient(base_url=admin.url, timeout=10) as client:
        r = await client.get("/readyz")
        assert r.status_code == 503
        assert r.json() == {
            "ready": False,
            "reason": "waiting for engine ranks [0] to register their KV caches",
        }
        assert (await client.get("/livez")).status_code == 200
        status = (await client.get("/v1/status")).json()
        assert status["ready"] is False and status["ranks"] == [
            {
                "rank": 0,
                "registered": False,
                "engine_id": None,
                "tp_size": None,
                "num_blocks": None,
                "null_block": None,
                "kv_layout": None,
                "layout_mode": None,
                "groups": 0,
                "regions": 0,
                "sends_in_flight": 0,
                "recvs_in_flight": 0,
                "sends_ended": 0,
                "recvs_ended": 0,
                "stream_queue_depth": 0,
                "stream_queue_capacity": 0,
                "layers_signalled_in_forward": 0,
                "layers_signalled_at_step_end": 0,
                "last_step": None,
            }
        ]
        assert (await client.get("/v1/regions")).json() == {"ranks": []}
        assert (await client.get("/v1/groups")).json() == {"groups": []}
        text = (await client.get("/metrics")).text
        assert "kvsidecar_ready 0.0" in text

        # The engine link is synchronous, as a vLLM worker's is: keep it off the loop.
        link, kv = await asyncio.to_thread(_register, sc.settings.engine_ipc)
        try:
            r = await client.get("/readyz")
            assert (r.status_code, r.json()) == (200, {"ready": True, "reason": "ready"})
            regions = (await client.get("/v1/regions")).json()["ranks"]
            assert [r["rank"] for r in regions] == [0]
            assert {x["kind"] for x in regions[0]["regions"]} == {"SPLIT"}
            assert regions[0]["num_blocks"] == PARAMS.num_blocks
            groups = (await client.get("/v1/groups")).json()["groups"]
            assert [(g["spec"], g["layers"]) for g in groups] == [("full_attention", [0, 1])]
            assert "kvsidecar_ready 1.0" in (await client.get("/metrics")).text
            # No token configured: abort is open, and an unknown id is a 404, not a 401.
            assert (await client.post("/v1/requests/x/abort")).status_code == 404
        finally:
            link.close()
            kv.close()

        # Shutdown began: out of rotation before the servers close.
        sc.stop_admitting()
        r = await client.get("/readyz")
        assert (r.status_code, r.json()["reason"]) == (
            503,
            "shutting down: not admitting requests",
        )


async def test_port_in_use_is_a_clear_error(sidecar: tuple[Sidecar, AdminServer]) -> None:
    sc, admin = sidecar
    settings = sc.settings.model_copy(update={"admin_port": admin.port})
    with pytest.raises(
        ConfigError, match=r"cannot listen on 127\.0\.0\.1:\d+.*KVSIDECAR_ADMIN_PORT"
    ):
        await AdminServer(sc, settings).start()


async def test_stop_releases_the_port(sidecar: tuple[Sidecar, AdminServer]) -> None:
    sc, admin = sidecar
    await admin.stop()
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient(base_url=admin.url, timeout=2) as client:
            await client.get("/livez")
    again = AdminServer(sc, sc.settings.model_copy(update={"admin_port": admin.port}))
    await again.start()
    try:
        async with httpx.AsyncClient(base_url=again.url, timeout=5) as client:
            assert (await client.get("/livez")).status_code == 200
    finally:
        await again.stop()
