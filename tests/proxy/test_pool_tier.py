"""The KV pool as the prefill pick's second tier, against HTTP fakes of the engines and of a
pool sidecar's ``/v1/pool/lookup`` (the real sidecar's lookup is tested against a real
Mooncake Store and engine in tests/connectors/vllm/test_pool_e2e.py).

p0 holds prompt A (the proxy routed it there) and is busy with another prompt; p1 holds
nothing. Without the pool, A goes back to p0 and queues; with the pool holding A, p1 loads it
for a quarter of a computed token each and wins.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tests.proxy.conftest import Cluster, ServerThread, bound_socket, wait_for

A = list(range(1000, 2088))  # 1088 tokens
B = [*A[:512], *range(5000, 6500)]  # shares A's first 512: picked where A is
BLOCK = 128


class FakePool:
    """A pool sidecar's lookup: serves the whole blocks a prompt shares with one it ``holds``
    (or answers ``status``, or ``forced`` as its hit whatever it holds)."""

    def __init__(self) -> None:
        self.holds: list[list[int]] = []
        self.status = 200
        self.forced: object = None
        self.asked: list[list[int]] = []
        self.bodies: list[dict[str, Any]] = []
        app = FastAPI()

        @app.post("/v1/pool/lookup")
        async def lookup(request: Request) -> JSONResponse:
            body = await request.json()
            ids = body["token_ids"]
            self.asked.append(ids)
            self.bodies.append(body)
            if self.status != 200:
                return JSONResponse({"detail": "store down"}, status_code=self.status)
            hit = self.hit(ids) if self.forced is None else self.forced
            return JSONResponse({"hit_tokens": hit, "block_size": BLOCK})

        self.server = ServerThread(app, bound_socket()).start()

    def hit(self, ids: list[int]) -> int:
        shared = 0
        for held in self.holds:
            n = next(
                (i for i, (a, b) in enumerate(zip(ids, held, strict=False)) if a != b),
                min(len(ids), len(held)),
            )
            shared = max(shared, n)
        # The engine computes the prompt's last token itself, as the real lookup leaves it.
        return min(shared, len(ids) - 1) // BLOCK * BLOCK


@pytest.fixture
def pool() -> Iterator[FakePool]:
    fake = FakePool()
    yield fake
    fake.server.stop()


def busy_cluster(make: Callable[..., Cluster], **cfg: Any) -> tuple[Cluster, str]:
    """Two prefills, cache-aware with a light load weight: A went to one (returned); B, which
    shares its start, will be held there, adding what is left to compute of it (1501)."""
    c = make(2, 1).start_proxy(prefill_policy="cache_aware", prefill_alpha=0.5, **cfg)
    first = c.post(prompt=A, max_tokens=1)
    assert first.status_code == 200
    holder = c.record(first.headers["x-kv-transfer-id"])["prefill"]
    return c, holder


def pick_for_a(c: Cluster, holder: str) -> dict[str, Any]:
    """A again while B is held on ``holder``: the prefill pick's record."""
    p = next(f for f in c.prefill if f.url == holder)
    p.behaviour.hold = threading.Event()
    with ThreadPoolExecutor(1) as ex:
        held = ex.submit(c.post, prompt=B, max_tokens=1)
        wait_for("B to be held", lambda: len(p.requests) == 2)
        r = c.post(prompt=A, max_tokens=1)
        p.behaviour.hold.set()
        assert held.result().status_code == 200
    assert r.status_code == 200
    return dict(c.record(r.headers["x-kv-transfer-id"])["prefill_pick"])


def test_a_busy_holder_loses_to_an_idle_instance_the_pool_serves(
    make_cluster: Callable[..., Cluster], pool: FakePool
) -> None:
    pool.holds = [A]
    c, holder = busy_cluster(make_cluster, pool_lookup=pool.server.url, pool_load_cost=0.25)
    pick = pick_for_a(c, holder)
    assert pick["url"] != holder
    assert (pick["hit_tier"], pick["pool_hit_tokens"], pick["hit_tokens"]) == ("pool", 1024, 0)
    assert pick["score"] == pytest.approx(0.75 * 1024)
    # The connector's question: the whole prompt (the hit leaves its last token).
    assert pool.asked[-1] == A


def test_the_lookup_names_the_tenant(make_cluster: Callable[..., Cluster], pool: FakePool) -> None:
    """The pool is asked with the request's cache_salt and model (an adapter's name), so a
    salted or adapter prompt is scored on its own tenant's entries only."""
    c = make_cluster().start_proxy(prefill_policy="cache_aware", pool_lookup=pool.server.url)
    assert c.post(prompt=A, max_tokens=1, cache_salt="tenant-1").status_code == 200
    assert (pool.bodies[-1]["cache_salt"], pool.bodies[-1]["model"]) == ("tenant-1", "tiny")
    assert c.post(prompt=A, max_tokens=1).status_code == 200
    assert pool.bodies[-1]["cache_salt"] is None


def test_without_the_pool_the_busy_holder_keeps_its_prompt(
    make_cluster: Callable[..., Cluster], pool: FakePool
) -> None:
    """The same requests: a pool that holds none of A leaves the pick to the engines' hits
    (B's 512 shared tokens are the holder's own hit: no pool tier for it either)."""
    c, holder = busy_cluster(make_cluster, pool_lookup=pool.server.url, pool_load_cost=0.25)
    pick = pick_for_a(c, holder)
    assert pick["url"] == holder
    assert (pick["hit_tier"], pick["pool_hit_tokens"]) == ("engine", 0)


def test_a_pool_that_does_not_answer_leaves_the_pick_to_the_engines(
    make_cluster: Callable[..., Cluster], pool: FakePool
) -> None:
    pool.holds, pool.status = [A], 503
    c, holder = busy_cluster(make_cluster, pool_lookup=pool.server.url)
    pick = pick_for_a(c, holder)
    assert pick["url"] == holder and pick["pool_hit_tokens"] == 0
    assert pick["pool_note"].startswith("pool lookup answered 503")
    text = c.post(prompt="a text prompt", max_tokens=1)
    note = c.record(text.headers["x-kv-transfer-id"])["prefill_pick"]["pool_note"]
    assert "text prompt" in note
