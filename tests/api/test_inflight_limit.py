"""Past the in-flight limit the admin API answers 503, but never to the health probes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from app.api import server as api_server
from app.api.server import AdminServer
from tests.api.conftest import in_process_sidecar

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def saturated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[AdminServer]:
    """An admin API whose limit is already reached: a limit of 0 requests in flight."""
    monkeypatch.setattr(api_server, "_MAX_INFLIGHT", 0)
    async with in_process_sidecar("limit", tmp_path) as (_, server):
        yield server


async def test_over_the_limit_is_503_except_health(saturated: AdminServer) -> None:
    async with httpx.AsyncClient(base_url=saturated.url, timeout=5) as client:
        for path in ("/v1/status", "/metrics"):
            r = await client.get(path)
            assert r.status_code == 503, (path, r.text)
            assert r.headers["retry-after"] == "1" and "in flight" in r.json()["detail"]
        assert (await client.get("/livez")).status_code == 200
        # Answered on its merits (no engine registered here), not by the limiter.
        assert "in flight" not in (await client.get("/readyz")).text
    assert saturated.inflight_limit.refused == 2
