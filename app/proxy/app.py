"""The proxy's FastAPI app: OpenAI-compatible routes, the target callback, health, records,
metrics."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from app.api.guards import BodyLimit, InflightLimit
from app.proxy.admin import admin_refusal
from app.proxy.balancer import HealthChecker, Pool, Routing, is_connection_failure
from app.proxy.bodies import TRANSFER_TOKEN_HEADER
from app.proxy.breaker import BreakerSettings
from app.proxy.config import ProxyConfig
from app.proxy.dp import upstream
from app.proxy.errors import NoHealthyInstance, error_response
from app.proxy.exchange import describe, forwarded_headers, read_json_object
from app.proxy.flow import PDFlow
from app.proxy.kv_events import KeyScheme, KvEventFeed, SubscriberSettings
from app.proxy.metrics import CONTENT_TYPE, CountInflight, ProxyMetrics
from app.proxy.precise import EngineHits
from app.proxy.records import TransferLog
from app.proxy.targets import MAX_PP_STAGES, Delivery, TargetRendezvous
from app.tracing.otel import open_tracing

log = logging.getLogger(__name__)

_REFUSED_KIND = {401: "authentication_error", 404: "not_found", 409: "conflict"}


def _health_body(
    pools: dict[str, Pool], flow: PDFlow, feed: KvEventFeed | None
) -> tuple[int, dict[str, Any]]:
    ok = all(p.any_healthy for p in pools.values())
    body: dict[str, Any] = {"status": "ok" if ok else "unavailable"}
    for role, pool in pools.items():
        body[role] = [dataclasses.asdict(i.status()) for i in pool.instances]
    # Per instance that publishes KV events: whether its index answers picks (consistent) or
    # the prefix index stands in for it, and why.
    body["kv_events"] = [] if feed is None else [dataclasses.asdict(s) for s in feed.status()]
    # Why the last request went where it went, per role (each transfer's record has its own).
    body["routing"] = {
        role: {
            "policy": pool.policy.value,
            "last_pick": None if pool.last_pick is None else dataclasses.asdict(pool.last_pick),
        }
        for role, pool in pools.items()
    }
    # Requests served by decode alone (short prompt, or held by decode) and through prefill.
    body["disaggregation"] = flow.counts.summary(flow.disagg)
    return (200 if ok else 503), body


def _feed(cfg: ProxyConfig) -> KvEventFeed | None:
    if not cfg.kv_events:
        return None
    return KvEventFeed(
        cfg.kv_events,
        SubscriberSettings(max_blocks=cfg.kv_events_max_blocks),
        KeyScheme.new(cfg.kv_events_unit),
    )


def _pools(cfg: ProxyConfig, hits: EngineHits | None) -> dict[str, Pool]:
    breaker = BreakerSettings(cfg.breaker_failures, cfg.breaker_probe_interval_s)
    prefill = Routing(cfg.prefill_policy, breaker, cfg.prefill_alpha, cfg.prefix_index_blocks)
    # Decode's index is what the disaggregation hit rule reads; kept only when it is on.
    decode = Routing(
        cfg.decode_policy,
        breaker,
        index_blocks=cfg.prefix_index_blocks,
        track_prefixes=cfg.disagg_rules.tracks_decode_prefixes,
    )
    return {
        "prefill": Pool("prefill", cfg.prefill, prefill, hits),
        "decode": Pool("decode", cfg.decode, decode, hits),
    }


# Transfer ids are the proxy's own uuids (36 characters).
MAX_TRANSFER_ID = 256
# Never refused for load: probes and scrapes (a busy proxy is still alive), and the engines'
# target rendezvous, which moves the transfers of requests already admitted.
_UNLIMITED = ("/health", "/metrics", "/v1/kv_targets")
_REFUSAL_KIND = {408: "timeout", 413: "invalid_request_error", 503: "service_unavailable"}


def _refusal(status: int, message: str) -> Response:
    return error_response(status, message, _REFUSAL_KIND.get(status, "service_unavailable"))


# Idle connections to the engines are dropped before the engines' own keep-alive timeout
# (uvicorn's and vLLM's default: 5 s) can close them: a request sent on a connection the server
# is closing fails with a read error, which the proxy cannot tell from a prefill that died with
# the prompt (measured once in 2152 requests of a soak, through the bench's tap: decode then
# recomputed the prompt).
UPSTREAM_KEEPALIVE_S = 2.0


def create_proxy(cfg: ProxyConfig) -> FastAPI:
    """The proxy app; it probes every instance once before serving, then every interval."""
    feed = _feed(cfg)
    pools = _pools(cfg, None if feed is None else EngineHits(feed))
    targets = TargetRendezvous(remember=cfg.transfer_log_size)
    transfers = TransferLog(cfg.transfer_log_size)
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s),
        # Unbounded: a streamed answer holds its connection for the whole decode.
        limits=httpx.Limits(
            max_connections=None,
            max_keepalive_connections=64,
            keepalive_expiry=UPSTREAM_KEEPALIVE_S,
        ),
        # Engines are reached directly; an HTTP(S)_PROXY meant for the outside must not apply.
        trust_env=False,
    )
    metrics = ProxyMetrics(pools, feed)
    flow = PDFlow(cfg, pools["prefill"], pools["decode"], targets, transfers, client, metrics)
    checker = HealthChecker(
        list(pools.values()), client, cfg.health_interval_s, cfg.health_timeout_s
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Spans are exported only when an OTLP endpoint is set (README "Tracing").
        flow.tracing = open_tracing("kv-sidecar-proxy")
        if feed is not None:
            await feed.start()
        await checker.probe_all()
        for role, pool in pools.items():
            if not pool.any_healthy:
                down = "; ".join(f"{i.url}: {i.last_error}" for i in pool.instances)
                log.warning("starting with no healthy %s instance (%s)", role, down)
        # Breakers are looked at a few times per probe interval, so a probe is at most a
        # quarter interval late.
        tick = min(max(cfg.breaker_probe_interval_s / 4, 0.01), 1.0)
        tasks = [
            asyncio.create_task(checker.run()),
            asyncio.create_task(checker.run_breakers(tick)),
        ]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await flow.close()
            if feed is not None:
                await feed.close()
            await client.aclose()
            if flow.tracing is not None:
                await asyncio.to_thread(flow.tracing.shutdown)  # exports what is buffered

    app = FastAPI(title="kv-sidecar proxy", lifespan=lifespan)
    # Added last is outermost: the in-flight count covers the time a body takes to arrive.
    app.add_middleware(
        BodyLimit,
        max_bytes=cfg.max_body_bytes,
        timeout_s=cfg.body_timeout_s,
        setting="--max-body-bytes",
        respond=_refusal,
    )
    # Inside the limit: the gauge counts what the limit let in.
    app.add_middleware(CountInflight, gauge=metrics.in_flight, exempt=_UNLIMITED)
    app.add_middleware(InflightLimit, limit=cfg.max_inflight, exempt=_UNLIMITED, respond=_refusal)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await flow.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await flow.handle(request, "/v1/chat/completions")

    @app.post("/v1/kv_targets")
    async def kv_targets(request: Request) -> Response:
        """Decode's connector: ``{"transfer_id", "target": {...}}`` or ``{..., "error"}``."""
        body = await read_json_object(request)
        if isinstance(body, Response):
            return body
        tid, target, error = body.get("transfer_id"), body.get("target"), body.get("error")
        if not isinstance(tid, str) or not 0 < len(tid) <= MAX_TRANSFER_ID:
            # Not echoed: a stranger's megabyte id stays out of the answer and the log.
            return error_response(
                400,
                f"transfer_id: expected a string of 1 to {MAX_TRANSFER_ID} characters",
                "invalid_request_error",
            )
        token = request.headers.get(TRANSFER_TOKEN_HEADER)
        # Pipeline parallel: which of decode's stages this is (targets.py).
        stage, size = body.get("pp_stage", 0), body.get("pp_size", 1)
        if not (type(stage) is int and type(size) is int):
            return error_response(
                400, "pp_stage and pp_size: expected integers", "invalid_request_error"
            )
        if isinstance(target, dict):
            delivery = targets.deliver(tid, token, target, stage, size)
        elif target is None and error is not None:
            delivery = targets.fail(tid, token, str(error))
        else:
            return error_response(
                400,
                "expected a target (a JSON object) or an error (a sentence)",
                "invalid_request_error",
            )
        if not delivery.accepted:
            targets.log_refused(delivery)  # throttled: strangers must not flood the log
            kind = _REFUSED_KIND.get(delivery.status, "invalid_request_error")
            return error_response(delivery.status, delivery.message, kind)
        flow.target_arrived(tid)
        return JSONResponse({"ok": True})

    @app.get("/v1/kv_targets/{transfer_id}")
    async def kv_target(
        request: Request,
        transfer_id: str,
        timeout_s: float | None = Query(None, gt=0, le=600),
        pp_stage: int = Query(0, ge=0, lt=MAX_PP_STAGES),
        pp_size: int = Query(1, ge=1, le=MAX_PP_STAGES),
    ) -> Response:
        """Prefill's connector (concurrent flow): decode's target, once it was posted.

        Waits up to ``timeout_s`` (default: the proxy's target timeout); 409 when the transfer
        stopped waiting (decode ended), with the reason, so prefill frees its blocks at once
        instead of at its deadline; 401 without the transfer's token."""
        if len(transfer_id) > MAX_TRANSFER_ID:
            return error_response(
                400,
                f"transfer_id: expected at most {MAX_TRANSFER_ID} characters",
                "invalid_request_error",
            )
        token = request.headers.get(TRANSFER_TOKEN_HEADER)
        got = await targets.fetch(
            transfer_id, token, timeout_s or cfg.target_timeout_s, pp_stage, pp_size
        )
        if isinstance(got, Delivery):
            kind = _REFUSED_KIND.get(got.status, "gateway_timeout")
            return error_response(got.status, got.message, kind)
        return JSONResponse({"transfer_id": transfer_id, "target": got})

    @app.get("/health")
    async def health() -> JSONResponse:
        code, body = _health_body(pools, flow, feed)
        return JSONResponse(body, status_code=code)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            d = pools["decode"].first_healthy()
        except NoHealthyInstance as e:
            return error_response(503, str(e), "service_unavailable")
        try:
            base, rank = upstream(d.url)
            r = await client.get(
                f"{base}/v1/models", headers={**forwarded_headers(request), **rank}
            )
        except httpx.HTTPError as e:
            if is_connection_failure(e):
                d.mark(False, f"connection failed: {describe(e)}")
            if isinstance(e, httpx.TimeoutException) and not is_connection_failure(e):
                return error_response(
                    504, f"decode instance {d.url} did not answer: {describe(e)}", "gateway_timeout"
                )
            msg = f"decode instance {d.url} could not be reached: {describe(e)}"
            return error_response(502, msg, "bad_gateway")
        headers = {k: r.headers[k] for k in ("content-type",) if k in r.headers}
        return Response(r.content, status_code=r.status_code, headers=headers)

    @app.get("/metrics")
    async def metrics_text() -> Response:
        """Prometheus text exposition (names prefixed ``kvproxy_``)."""
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/transfers")
    async def list_transfers(request: Request, limit: int | None = Query(None, ge=0)) -> Response:
        """The last transfers, oldest first (at most ``limit``); operators only (admin.py)."""
        denied = admin_refusal(request, cfg.admin_token)
        if denied is not None:
            return denied
        return JSONResponse(
            {"transfers": [dataclasses.asdict(r) for r in transfers.records(limit)]}
        )

    @app.get("/v1/transfers/{transfer_id}")
    async def get_transfer(request: Request, transfer_id: str) -> Response:
        denied = admin_refusal(request, cfg.admin_token)
        if denied is not None:
            return denied
        record = transfers.get(transfer_id)
        if record is None:
            return error_response(404, f"no recent transfer {transfer_id!r}", "not_found")
        return JSONResponse(dataclasses.asdict(record))

    return app
