"""``kv-sidecar proxy``: an OpenAI-compatible front running the decode-first flow (DESIGN §2).

1. The client's request goes to a decode instance with ``kv_transfer_params =
   {do_remote_prefill, transfer_id, router_url}``; it streams (or returns) the final answer.
2. Decode's connector, once its blocks are allocated, POSTs its target to ``router_url``
   (``/v1/kv_targets``): sidecar address, epoch, engine id, TP size, block ids per group.
3. The proxy then sends the prompt to a prefill instance with ``max_tokens=1`` and
   ``kv_transfer_params = {do_remote_decode, transfer_id, remote: target}``.
4. Decode's answer is relayed as it comes. A client that goes away closes both upstream
   requests, which vLLM turns into aborts (and the connector into sidecar aborts).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

log = logging.getLogger(__name__)


@dataclass
class Upstream:
    url: str
    healthy: bool = True
    outstanding: int = 0


@dataclass
class ProxyConfig:
    prefill: list[str]
    decode: list[str]
    public_url: str
    policy: str = "round_robin"  # or least_outstanding
    target_timeout_s: float = 30.0
    request_timeout_s: float = 600.0
    health_interval_s: float = 5.0


@dataclass
class Transfer:
    transfer_id: str
    decode: str
    prefill: str = ""
    target_ms: float | None = None
    prefill_ms: float | None = None
    total_ms: float | None = None
    status: str = "pending"
    started: float = field(default_factory=time.monotonic)


class Pool:
    """Instances of one role, picked round-robin or by fewest requests in flight."""

    def __init__(self, role: str, urls: list[str], policy: str) -> None:
        self.role, self.policy = role, policy
        self.items = [Upstream(u.rstrip("/")) for u in urls]
        self._rr = itertools.count()

    def pick(self) -> Upstream:
        live = [u for u in self.items if u.healthy]
        if not live:
            tried = ", ".join(u.url for u in self.items)
            raise LookupError(f"no healthy {self.role} instance (tried: {tried})")
        if self.policy == "least_outstanding":
            return min(live, key=lambda u: u.outstanding)
        return live[next(self._rr) % len(live)]


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


def create_proxy(cfg: ProxyConfig) -> FastAPI:
    """The proxy app; health probes run while it serves."""
    pools = {
        "prefill": Pool("prefill", cfg.prefill, cfg.policy),
        "decode": Pool("decode", cfg.decode, cfg.policy),
    }
    waiters: dict[str, asyncio.Future[dict[str, Any]]] = {}
    transfers: deque[Transfer] = deque(maxlen=1000)
    client = httpx.AsyncClient(timeout=httpx.Timeout(cfg.request_timeout_s, connect=5.0))

    async def probe() -> None:
        while True:
            for pool in pools.values():
                for u in pool.items:
                    try:
                        r = await client.get(f"{u.url}/health", timeout=3.0)
                        u.healthy = r.status_code == 200
                    except httpx.HTTPError:
                        u.healthy = False
            await asyncio.sleep(cfg.health_interval_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(probe())
        yield
        task.cancel()
        await client.aclose()

    app = FastAPI(title="kv-sidecar proxy", lifespan=lifespan)

    @app.get("/health")
    async def health() -> JSONResponse:
        body = {
            role: [{"url": u.url, "healthy": u.healthy} for u in p.items]
            for role, p in pools.items()
        }
        ok = all(any(u.healthy for u in p.items) for p in pools.values())
        return JSONResponse(
            {"status": "ok" if ok else "unavailable", **body}, status_code=200 if ok else 503
        )

    @app.get("/v1/models")
    async def models() -> Response:
        try:
            d = pools["decode"].pick()
            r = await client.get(f"{d.url}/v1/models")
        except LookupError as e:
            return _error(503, str(e), "service_unavailable")
        except httpx.HTTPError as e:
            return _error(502, f"decode instance failed: {e}", "bad_gateway")
        return Response(r.content, r.status_code, media_type="application/json")

    @app.get("/v1/transfers")
    async def list_transfers() -> JSONResponse:
        return JSONResponse({"transfers": [t.__dict__ | {"started": None} for t in transfers]})

    @app.post("/v1/kv_targets")
    async def kv_target(request: Request) -> JSONResponse:
        body = await request.json()
        fut = waiters.get(str(body.get("transfer_id")))
        if fut is None or fut.done():
            return _error(
                404, f"unknown or finished transfer {body.get('transfer_id')!r}", "not_found"
            )
        if "target" in body:
            fut.set_result(dict(body["target"]))
        else:
            fut.set_exception(RuntimeError(str(body.get("error", "decode gave no target"))))
        return JSONResponse({"ok": True})

    async def prefill(t: Transfer, body: dict[str, Any], path: str) -> None:
        fut = waiters[t.transfer_id]
        try:
            target = await asyncio.wait_for(fut, cfg.target_timeout_s)
        except (TimeoutError, RuntimeError, asyncio.CancelledError) as e:
            t.status = f"no target: {e or 'timeout'}"
            return
        finally:
            waiters.pop(t.transfer_id, None)
        t.target_ms = (time.monotonic() - t.started) * 1e3
        try:
            p = pools["prefill"].pick()
        except LookupError as e:
            t.status = str(e)
            return
        t.prefill = p.url
        pbody = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        pbody.update(
            max_tokens=1,
            stream=False,
            kv_transfer_params={
                "do_remote_decode": True,
                "transfer_id": t.transfer_id,
                "remote": target,
            },
        )
        if "max_completion_tokens" in pbody:
            pbody["max_completion_tokens"] = 1
        t0 = time.monotonic()
        p.outstanding += 1
        try:
            r = await client.post(f"{p.url}{path}", json=pbody)
            t.status = "prefilled" if r.status_code == 200 else f"prefill {r.status_code}"
        except httpx.HTTPError as e:
            p.healthy = isinstance(e, httpx.TimeoutException)
            t.status = f"prefill failed: {e}"
            log.error("prefill %s failed for %s: %s", p.url, t.transfer_id, e)
        finally:
            p.outstanding -= 1
            t.prefill_ms = (time.monotonic() - t0) * 1e3

    async def route(request: Request, path: str) -> Response:
        body = await request.json()
        try:
            d = pools["decode"].pick()
            pools["prefill"].pick()  # fail fast when no prefill can serve
        except LookupError as e:
            return _error(503, str(e), "service_unavailable")
        t = Transfer(uuid.uuid4().hex, d.url)
        transfers.append(t)
        waiters[t.transfer_id] = asyncio.get_running_loop().create_future()
        dbody = dict(
            body,
            kv_transfer_params={
                "do_remote_prefill": True,
                "transfer_id": t.transfer_id,
                "router_url": f"{cfg.public_url}/v1/kv_targets",
            },
        )
        side = asyncio.create_task(prefill(t, body, path))
        d.outstanding += 1
        try:
            upstream = await client.send(
                client.build_request("POST", f"{d.url}{path}", json=dbody), stream=True
            )
        except httpx.HTTPError as e:
            d.outstanding -= 1
            d.healthy = isinstance(e, httpx.TimeoutException)
            side.cancel()
            return _error(502, f"decode instance {d.url} failed: {e}", "bad_gateway")

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
                t.status = (
                    "done" if upstream.status_code == 200 else f"decode {upstream.status_code}"
                )
            finally:
                # Also runs when the client went away: closing both upstreams aborts them.
                await upstream.aclose()
                if t.target_ms is None and not side.done():
                    side.cancel()  # decode ended before it asked for a prefill
                d.outstanding -= 1
                t.total_ms = (time.monotonic() - t.started) * 1e3

        return StreamingResponse(
            relay(),
            status_code=upstream.status_code,
            media_type=upstream.headers.get("content-type"),
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await route(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await route(request, "/v1/chat/completions")

    return app
