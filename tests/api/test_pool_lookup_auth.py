"""``POST /v1/pool/lookup`` tells whether a token sequence is cached: with an admin token set,
only a caller holding it is answered (anyone else could probe other clients' prompts); without
one it is open, as every admin call is.

In process (ASGI, no sockets) on a sidecar that was never started, its pool replaced by a stub
that answers every lookup, so a refusal can only come from the credential check.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from app.api.server import create_app
from app.transfer.sidecar.process import Sidecar
from tests.conftest import one_rank_settings

TOKEN = "pool-lookup-token"
BODY = {"token_ids": list(range(64))}


class StubPool:
    """Holds the first 48 tokens of every prompt, in blocks of 16; counts the questions."""

    def __init__(self) -> None:
        self.asked = 0

    async def router_lookup(
        self, token_ids: Sequence[int], cache_salt: str | None = None, model: str | None = None
    ) -> tuple[int, int]:
        self.asked += 1
        return min(48, len(token_ids)), 16


async def _app(tmp_path: Path, token: str | None) -> tuple[FastAPI, Sidecar, StubPool]:
    settings = one_rank_settings("prefill", "pool-auth", tmp_path, token)
    sidecar = Sidecar(settings)
    stub = StubPool()
    sidecar.registry.pool = stub  # type: ignore[assignment]
    return create_app(sidecar, settings), sidecar, stub


@pytest.fixture
async def guarded(tmp_path: Path) -> AsyncIterator[tuple[FastAPI, StubPool]]:
    app, sidecar, stub = await _app(tmp_path, TOKEN)
    yield app, stub
    app.state.metrics.close()
    sidecar.ctx.term()


@pytest.fixture
async def open_app(tmp_path: Path) -> AsyncIterator[tuple[FastAPI, StubPool]]:
    app, sidecar, stub = await _app(tmp_path, None)
    yield app, stub
    app.state.metrics.close()
    sidecar.ctx.term()


async def _lookup(app: FastAPI, headers: dict[str, str]) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://admin") as client:
        return await client.post("/v1/pool/lookup", json=BODY, headers=headers)


async def test_a_caller_without_the_token_is_refused_before_the_pool_is_asked(
    guarded: tuple[FastAPI, StubPool],
) -> None:
    app, stub = guarded
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic x"}):
        r = await _lookup(app, headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert "token" in r.json()["detail"]
    assert stub.asked == 0  # nothing about the prompt was looked up, let alone answered


async def test_the_token_holder_gets_the_answer(guarded: tuple[FastAPI, StubPool]) -> None:
    app, stub = guarded
    r = await _lookup(app, {"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200, r.text
    assert r.json() == {"hit_tokens": 48, "block_size": 16}
    assert stub.asked == 1


async def test_without_a_token_the_lookup_is_open_like_every_admin_call(
    open_app: tuple[FastAPI, StubPool],
) -> None:
    app, _ = open_app
    r = await _lookup(app, {})
    assert (r.status_code, r.json()) == (200, {"hit_tokens": 48, "block_size": 16})


def test_the_openapi_documents_the_refusal(guarded: tuple[FastAPI, StubPool]) -> None:
    op = guarded[0].openapi()["paths"]["/v1/pool/lookup"]["post"]
    assert "401" in op["responses"] and op["security"] == [{"HTTPBearer": []}]
