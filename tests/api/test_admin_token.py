"""Every mutating route is refused by the admin token dependency, before its handler runs.

In process (ASGI, no sockets) on a sidecar that was never started: a refusal must come from the
dependency alone. The routes are read from the app, so a new write route is covered as soon as it
exists, and fails here until it checks the token or is listed as read-only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute

from app.api.server import create_app
from app.transfer.sidecar.process import Sidecar
from tests.conftest import one_rank_settings

TOKEN = "in-process-token"
# A POST only because its input does not fit a query string: it changes nothing.
READ_ONLY = {("POST", "/v1/pool/lookup")}
# A body that reaches the token check: a kv_targets target is checked by its signature instead.
BODIES: dict[str, Any] = {
    "/v1/kv_targets": {"transfer_id": "no-such-send", "error": "full"},
    "/v1/kv_digest": {"share": 0.5},
}
# What a call past the token check answers: nothing by that id here (404), or done (200).
PAST_THE_CHECK = {"/v1/kv_digest": 200}


@pytest.fixture(params=[TOKEN, None], ids=["token", "no-token"])
async def app(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[FastAPI]:
    settings = one_rank_settings("prefill", "token-check", tmp_path, request.param)
    sidecar = Sidecar(settings)
    app = create_app(sidecar, settings)
    yield app
    app.state.metrics.close()
    sidecar.ctx.term()


def _mutating(app: FastAPI) -> list[tuple[str, str]]:
    routes = [
        (method, route.path)
        for route in app.routes
        if isinstance(route, APIRoute)
        for method in sorted(route.methods - {"GET", "HEAD"})
    ]
    return [r for r in routes if r not in READ_ONLY]


async def _call(app: FastAPI, method: str, path: str, **kw: Any) -> httpx.Response:
    url = path.replace("{request_id}", "no-such-request")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://admin") as client:
        return await client.request(method, url, json=BODIES.get(path), **kw)


async def test_every_mutating_route_needs_the_token_when_one_is_set(app: FastAPI) -> None:
    mutating = _mutating(app)
    assert {p for _, p in mutating} == {
        "/v1/requests/{request_id}/abort",
        "/v1/kv_targets",
        "/v1/kv_digest",
    }
    guarded = app.state.admin_token is not None
    for method, path in mutating:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = await _call(app, method, path, headers=headers)
            if guarded:
                assert r.status_code == 401, (path, headers, r.text)
                assert r.headers["www-authenticate"].startswith("Bearer")
                assert "token" in r.json()["detail"]
            else:  # open: past the dependency, the handler runs
                assert r.status_code == PAST_THE_CHECK.get(path, 404), (path, headers, r.text)
        # With the token the handler runs.
        ok = await _call(app, method, path, headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == PAST_THE_CHECK.get(path, 404), (path, ok.text)


async def test_the_openapi_documents_the_token_only_when_one_is_set(app: FastAPI) -> None:
    guarded = app.state.admin_token is not None
    paths = app.openapi()["paths"]
    for method, path in _mutating(app):
        op = paths[path][method.lower()]
        # kv_targets answers 401 for a target with a bad signature too, token or not.
        documented = guarded or path == "/v1/kv_targets"
        assert ("401" in op["responses"]) is documented, path
        assert ("security" in op) is documented, path
