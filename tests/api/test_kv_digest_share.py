"""``/v1/kv_digest``: the digest's share is read by anyone and changed only with the admin token
(when one is set), within [0, 1].

In process (ASGI, no sockets) on a sidecar that was never started. That a changed share changes
which pushes are digested, on real sidecars and engines: ``tests/bench/pd/test_quick.py``'s
digest run (one pair, each arm setting its share here before its trial)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from app.api.server import create_app
from app.transfer.sidecar.process import Sidecar
from tests.conftest import one_rank_settings

TOKEN = "digest-token"


@pytest.fixture
async def app_and_sidecar(tmp_path: Path) -> AsyncIterator[tuple[FastAPI, Sidecar]]:
    settings = one_rank_settings("prefill", "digest-share", tmp_path, TOKEN)
    sidecar = Sidecar(settings)
    app = create_app(sidecar, settings)
    yield app, sidecar
    app.state.metrics.close()
    sidecar.ctx.term()


def _client(app: FastAPI, token: str | None = None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://sidecar", headers=headers
    )


async def test_the_share_is_read_and_changed_with_the_token(
    app_and_sidecar: tuple[FastAPI, Sidecar],
) -> None:
    app, sidecar = app_and_sidecar
    async with _client(app) as c:
        r = await c.get("/v1/kv_digest")
        assert r.status_code == 200 and r.json()["share"] == 0.125  # the settings' default
    async with _client(app, TOKEN) as c:
        r = await c.put("/v1/kv_digest", json={"share": 1.0})
        assert r.status_code == 200, r.text
        assert r.json() == {"share": 1.0, "previous": 0.125}
    assert sidecar.digest.value == 1.0


async def test_no_token_or_a_share_out_of_range_changes_nothing(
    app_and_sidecar: tuple[FastAPI, Sidecar],
) -> None:
    app, sidecar = app_and_sidecar
    async with _client(app) as c:
        assert (await c.put("/v1/kv_digest", json={"share": 0.0})).status_code == 401
    async with _client(app, "wrong") as c:
        assert (await c.put("/v1/kv_digest", json={"share": 0.0})).status_code == 401
    async with _client(app, TOKEN) as c:
        for bad in (-0.1, 1.5, "all", None):
            r = await c.put("/v1/kv_digest", json={"share": bad})
            assert r.status_code == 422, (bad, r.text)
    assert sidecar.digest.value == 0.125
