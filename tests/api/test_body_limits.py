"""Request bodies on the admin API are bounded in size (413) and in time (408), and clients
that send bodies slowly never take the status pages or the health probes down with them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from app.api import server as api_server
from app.api.server import AdminServer
from tests.api.conftest import in_process_sidecar

pytestmark = pytest.mark.timeout(120)

# Long enough that all the slow writers below reach the in-flight limiter before the first of
# them times out and frees its slot (at 1 s, a loaded 2-core machine once let a late writer in:
# 65 answers of 408, not 64).
BODY_TIMEOUT_S = 3.0


@pytest.fixture
async def admin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[AdminServer]:
    monkeypatch.setattr(api_server, "_BODY_TIMEOUT_S", BODY_TIMEOUT_S)
    async with in_process_sidecar("bodies", tmp_path) as (_, server):
        yield server


async def test_body_over_the_cap_is_413(admin: AdminServer) -> None:
    cap = admin.settings.admin_max_body_bytes
    big = {"transfer_id": "t", "error": "x" * cap}
    async with httpx.AsyncClient(base_url=admin.url, timeout=10) as client:
        declared = await client.post("/v1/kv_targets", json=big)

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it comes
            for _ in range(cap // 4096 + 2):
                yield b" " * 4096

        streamed = await client.post("/v1/kv_targets", content=chunks())
        small = await client.post("/v1/kv_targets", json={"transfer_id": "t", "error": "e"})
    for r in (declared, streamed):
        assert r.status_code == 413, r.text
        assert f"at most {cap} bytes" in r.json()["detail"]
    assert small.status_code == 404, small.text  # read whole and handled as before


async def test_slow_bodies_time_out_and_never_starve_status_or_probes(admin: AdminServer) -> None:
    host, port = admin.host, admin.port
    slow: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    # More slow writers than the API's in-flight limit, each stuck halfway through its body.
    for _ in range(api_server._MAX_INFLIGHT + 8):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(
            b"POST /v1/kv_targets HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n" + b'{"transfer_id": '
        )
        await writer.drain()
        slow.append((reader, writer))
    await asyncio.sleep(0.2)
    async with httpx.AsyncClient(base_url=admin.url, timeout=5) as client:
        status = await client.get("/v1/status")
        livez = await client.get("/livez")
        readyz = await client.get("/readyz")
    assert status.status_code == 200, status.text
    assert livez.status_code == 200
    assert "in flight" not in readyz.text  # answered on its merits, not by the limiter
    # Each slow body within the write limit is answered 408 once its deadline passed, the
    # rest 503 at once, and every connection is closed.
    answers = await asyncio.gather(
        *(asyncio.wait_for(reader.read(), BODY_TIMEOUT_S + 10) for reader, _ in slow)
    )
    for _, writer in slow:
        writer.close()
    codes = sorted(a.split(b" ", 2)[1].decode() for a in answers)
    assert codes == ["408"] * api_server._MAX_INFLIGHT + ["503"] * 8
    timed_out = next(a for a in answers if a.startswith(b"HTTP/1.1 408"))
    assert f"did not arrive within {BODY_TIMEOUT_S:g} s".encode() in timed_out
