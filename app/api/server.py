"""The admin API (DESIGN §8): FastAPI on uvicorn, inside the sidecar's own event loop.

Handlers are ``async def`` on purpose: they then run on the loop that owns every request and
counter, read a consistent snapshot without locks, and never wait on a transfer. The one mutating
call, abort, goes through the sidecar like an engine's abort would.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import time
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import uvicorn
from fastapi import Body, Depends, FastAPI, HTTPException, Path, Query, status
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BeforeValidator

try:  # what uvicorn's "auto" picks when it is installed
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _HTTPProtocol
except ImportError:  # pragma: no cover - h11 always ships with uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol as _HTTPProtocol  # type: ignore[assignment]

from app.api import views
from app.api.guards import BodyLimit, InflightLimit
from app.api.metrics import SidecarMetrics
from app.api.schemas import (
    AbortBody,
    AbortResponse,
    ErrorResponse,
    GroupsResponse,
    KVTargetBody,
    KVTargetResponse,
    Liveness,
    PeersResponse,
    PoolLookupBody,
    PoolLookupResponse,
    PoolResponse,
    Readiness,
    RegionsResponse,
    RegistrationResponse,
    RequestList,
    RequestLookup,
    RequestState,
    StatusResponse,
)
from app.config import SidecarSettings, env_var_for
from app.errors import AuthError, ConfigError, DeadlineExceeded, KVSidecarError
from app.transfer.protocol import remote_target
from app.transfer.sidecar import Sidecar

log = logging.getLogger(__name__)

# Probes and scrapes are small; past this many requests in flight the API answers 503 instead of
# queueing work on the loop that also runs the control plane.
_MAX_INFLIGHT = 64
# An idle connection (before its first request or between requests) is closed after this long.
_IDLE_TIMEOUT_S = 5
# A body (a target, an abort reason) is a few KiB and comes in one packet: a client still
# sending after this long is stuck or hostile, and holds a slot of the write limit meanwhile.
_BODY_TIMEOUT_S = 10.0

_RequestId = Annotated[str, Path(description="The request id the engine admitted.")]


def _upper(value: object) -> object:
    return value.upper() if isinstance(value, str) else value


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


_bearer = HTTPBearer(auto_error=False, description=f"The value of {env_var_for('admin_token')}.")


class _TokenCheck:
    """Dependency of mutating calls: 401 unless the bearer token matches."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def __call__(
        self, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
    ) -> None:
        self.check(creds)

    def check(self, creds: HTTPAuthorizationCredentials | None) -> None:
        """Raise 401 unless ``creds`` carry the token."""
        if creds is None:
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                detail="this call needs the admin token: send 'Authorization: Bearer <token>'",
                headers={"WWW-Authenticate": "Bearer"},
            )
        # Constant time: the token must not leak through response timing.
        if not secrets.compare_digest(creds.credentials.encode(), self._token):
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                detail="the bearer token does not match this sidecar's admin token",
                headers={"WWW-Authenticate": 'Bearer error="invalid_token"'},
            )


def create_app(sidecar: Sidecar, settings: SidecarSettings) -> FastAPI:
    """The admin app of one sidecar, with its own metrics registry."""
    app = FastAPI(
        title="kv-sidecar admin API",
        version=views.versions().kv_sidecar,
        description=(
            "Health, state and metrics of one kv-sidecar process, and request abort. Read-only "
            "calls need no credentials; mutating calls need the bearer token when "
            f"{env_var_for('admin_token')} is set."
        ),
    )
    metrics = SidecarMetrics(sidecar)
    app.state.sidecar = sidecar
    app.state.metrics = metrics

    token = settings.admin_token
    token_check = None if token is None else _TokenCheck(token.get_secret_value())
    mutating: dict[str, Any] = {}
    if token_check is not None:
        mutating = {
            "dependencies": [Depends(token_check)],
            "responses": {401: _error("Missing or wrong bearer token.")},
        }

    @app.get("/livez", response_model=Liveness, tags=["health"])
    async def livez() -> Liveness:
        """The process and its event loop answer."""
        return Liveness()

    @app.get(
        "/readyz",
        response_model=Readiness,
        tags=["health"],
        responses={503: {"model": Readiness, "description": "Not ready; the reason says why."}},
    )
    async def readyz() -> JSONResponse:
        """Ready once every configured rank registered its KV caches and the ports are bound."""
        ok, reason = views.readiness(sidecar)
        body = Readiness(ready=ok, reason=reason).model_dump()
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        tags=["health"],
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
    )
    async def metrics_text() -> PlainTextResponse:
        """Prometheus text exposition (names prefixed ``kvsidecar_``, base units)."""
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/status", response_model=StatusResponse, tags=["state"])
    async def get_status() -> StatusResponse:
        """Identity, readiness, ranks, Mooncake session and counters, versions."""
        return views.status(sidecar)

    @app.get("/v1/regions", response_model=RegionsResponse, tags=["state"])
    async def get_regions() -> RegionsResponse:
        """The registered KV memory of each rank, as peers see it."""
        return views.regions(sidecar)

    @app.get("/v1/registration", response_model=RegistrationResponse, tags=["state"])
    async def get_registration() -> RegistrationResponse:
        """What each rank's engine registered (ranks registered from presets are absent)."""
        return views.registrations(sidecar)

    @app.get("/v1/groups", response_model=GroupsResponse, tags=["state"])
    async def get_groups() -> GroupsResponse:
        """Per KV cache group: its spec and transfer counters summed over ranks."""
        return views.groups(sidecar)

    @app.get("/v1/requests", response_model=RequestList, tags=["requests"])
    async def list_requests(
        state: Annotated[
            RequestState | None,
            BeforeValidator(_upper),
            Query(description="Only requests in this state (case-insensitive)."),
        ] = None,
        side: Annotated[Literal["send", "recv"] | None, Query()] = None,
        rank: Annotated[int | None, Query(ge=0)] = None,
        ended: Annotated[
            bool,
            Query(
                description="Also the recently ended ones (the last 256 per rank), e.g. for "
                "a benchmark that reads every request's timings once a run is over."
            ),
        ] = False,
    ) -> RequestList:
        """Requests the agents hold: in flight, or final and not yet reported to the engine
        (``ended=true``: and the recently ended ones)."""
        now = time.monotonic()
        out = []
        held = views.live_requests(sidecar)
        if ended:  # a request still held is shown as held, not also as its history copy
            seen = {(r.id, r.rank, type(r)) for r in held}
            held += [
                r for r in views.ended_requests(sidecar) if (r.id, r.rank, type(r)) not in seen
            ]
        for req in held:
            v = views.request_view(req, now)
            if (
                (state is None or v.state is state)
                and (side is None or v.side == side)
                and (rank is None or v.rank == rank)
            ):
                out.append(v)
        return RequestList(count=len(out), requests=out)

    @app.get(
        "/v1/requests/{request_id}",
        response_model=RequestLookup,
        tags=["requests"],
        responses={404: _error("No rank holds or recently ended this request.")},
    )
    async def get_request(request_id: _RequestId) -> RequestLookup:
        """One request on every rank and side that holds it, or recently ended it."""
        found = views.find_request(sidecar, request_id)
        if not found:
            raise HTTPException(404, detail=_unknown(request_id))
        now = time.monotonic()
        entries = [views.request_view(r, now, timeline=True) for r in found]
        return RequestLookup(id=request_id, entries=entries)

    @app.post(
        "/v1/requests/{request_id}/abort",
        response_model=AbortResponse,
        tags=["requests"],
        responses={
            400: _error("The body is not valid JSON."),
            404: _error("No rank holds or recently ended this request."),
            409: _error("The request already ended on every rank."),
            **mutating.get("responses", {}),
        },
        dependencies=mutating.get("dependencies", []),
    )
    async def abort_request(
        request_id: _RequestId,
        body: Annotated[AbortBody | None, Body()] = None,
    ) -> AbortResponse:
        """End the request as ABORTED on every rank that holds it; prefill tells decode."""
        reason = (body or AbortBody()).reason
        found = views.find_request(sidecar, request_id)
        if not found:
            raise HTTPException(404, detail=_unknown(request_id))
        live = sorted({r.rank for r in found if not r.state.terminal})
        if not live:
            states = ", ".join(f"{r.state.name} on rank {r.rank}" for r in found)
            raise HTTPException(409, detail=f"request {request_id} already ended: {states}")
        for rank in live:
            # Marks it ABORTED before its first await; the peer's ack is bounded by ack_timeout_s.
            try:
                await sidecar.abort(rank, request_id, reason)
            except KVSidecarError as e:  # aborted here all the same; only telling the peer failed
                log.warning(
                    "abort of %s on rank %d: could not tell the peer: %s", request_id, rank, e
                )
        now = time.monotonic()
        entries = [views.request_view(r, now) for r in views.find_request(sidecar, request_id)]
        return AbortResponse(id=request_id, aborted=live, entries=entries)

    @app.post(
        "/v1/kv_targets",
        response_model=KVTargetResponse,
        tags=["requests"],
        responses={
            400: _error("Neither a usable target nor an error."),
            401: _error("A target not signed by decode's sidecar, or an error without the token."),
            404: _error("No rank holds a send by that id."),
            409: _error("The send already ended or already has a target."),
        },
    )
    async def post_kv_target(
        body: KVTargetBody,
        creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> KVTargetResponse:
        """Prefill first: decode's connector says where a send this sidecar holds goes (the
        ``router_url`` prefill's answer named), or why it cannot take it (the send ends
        ABORTED at once and prefill's blocks go back).

        A target is authenticated by decode's sidecar's signature (the engines hold no admin
        token); an error ends a transfer like an abort and needs the admin token when set."""
        tid = body.transfer_id
        if body.target is None and token_check is not None:
            token_check.check(creds)
        # Which sends are held is no secret (GET /v1/requests lists them); what a target may do
        # is decided by its signature, below.
        holders = [r.rank for r in views.find_request(sidecar, tid) if views.side_of(r) == "send"]
        if not holders:
            raise HTTPException(
                404,
                detail=f"no send {tid!r} on this sidecar: this is not prefill's sidecar for it, "
                "or the prompt was not sent with do_remote_decode",
            )
        if body.target is None:
            if body.error is None:
                raise HTTPException(400, detail="expected a target (an object) or an error")
            ended = [rank for rank in holders if await _abort_quietly(rank, tid, body.error)]
            if not ended:
                raise HTTPException(409, detail=f"send {tid!r} already ended")
            return KVTargetResponse(transfer_id=tid, ranks=ended)
        try:
            outcome = sidecar.set_target(tid, remote_target(body.target))
        except AuthError as e:
            raise HTTPException(401, detail=str(e)) from None
        except KVSidecarError as e:
            raise HTTPException(400, detail=str(e)) from None
        refused = {rank: why for rank, why in outcome.items() if why is not None}
        taken = sorted(set(outcome) - set(refused))
        if refused or not taken:
            # Not held any more: it ended and was reported, so no target can be taken.
            why = "; ".join(f"rank {r}: {w}" for r, w in sorted(refused.items()))
            raise HTTPException(409, detail=why or f"send {tid!r} already ended")
        return KVTargetResponse(transfer_id=tid, ranks=taken)

    async def _abort_quietly(rank: int, tid: str, error: str) -> bool:
        try:
            return await sidecar.abort(rank, tid, f"decode gave no target: {error}")
        except KVSidecarError as e:  # aborted here all the same; only telling the peer failed
            log.warning("abort of %s on rank %d: could not tell the peer: %s", tid, rank, e)
            return True

    @app.get("/v1/peers", response_model=PeersResponse, tags=["state"])
    async def get_peers() -> PeersResponse:
        """Decode sidecars this one handshook with (prefill side)."""
        return views.peers(sidecar)

    @app.get("/v1/pool", response_model=PoolResponse, tags=["pool"])
    async def get_pool() -> PoolResponse:
        """The shared KV pool (Mooncake Store): hits, misses, bytes, keys, back-pressure."""
        return views.pool(sidecar)

    @app.post(
        "/v1/pool/lookup",
        response_model=PoolLookupResponse,
        tags=["pool"],
        responses={
            400: _error("The body is not JSON."),
            409: _error("The KV pool is not enabled on this sidecar."),
            503: _error("The pool's store did not answer."),
        },
    )
    async def pool_lookup(body: PoolLookupBody) -> PoolLookupResponse:
        """How much of a prompt the shared KV pool could serve an engine now (the proxy's
        second tier): one batched existence check, read-only."""
        svc = sidecar.pool
        if svc is None:
            raise HTTPException(
                409, detail="the KV pool is not enabled on this sidecar (KVSIDECAR_POOL__ENABLED)"
            )
        try:
            hit, block = await svc.router_lookup(body.token_ids, body.extra_keys)
        except KVSidecarError as e:  # the store unreachable or slow: the router goes without
            raise HTTPException(503, detail=f"the KV pool did not answer: {e}") from None
        return PoolLookupResponse(hit_tokens=hit, block_size=block)

    return app


def _unknown(rid: str) -> str:
    return f"request {rid} is not known to this sidecar (neither in flight nor recently ended)"


class _IdleBoundedHTTP(_HTTPProtocol):
    """uvicorn's HTTP protocol with its keep-alive timer armed from the connection's start.

    uvicorn arms it only after a response, so a connection that never sent a request stayed
    open for good; now every idle connection is closed after ``timeout_keep_alive``.
    """

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers: the sidecar's process owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=128)
    except OSError as e:
        raise ConfigError(
            f"the admin API cannot listen on {host}:{port}: {e.strerror or e}; set "
            f"{env_var_for('admin_port')} to a free port"
        ) from e


class AdminServer:
    """Serves ``create_app`` on ``admin_host:admin_port`` as a task in the running loop."""

    def __init__(self, sidecar: Sidecar, settings: SidecarSettings) -> None:
        self.sidecar = sidecar
        self.settings = settings
        self.app = create_app(sidecar, settings)
        self.body_limit = BodyLimit(self.app, settings.admin_max_body_bytes, _BODY_TIMEOUT_S)
        self.inflight_limit = InflightLimit(self.body_limit, _MAX_INFLIGHT)
        self.host = settings.admin_host
        self.port = settings.admin_port
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self, timeout_s: float = 10.0) -> None:
        """Bind, serve, and return once the socket accepts connections."""
        try:
            sock = _bind(self.host, self.port)
        except ConfigError:
            self.app.state.metrics.close()
            raise
        self.port = int(sock.getsockname()[1])
        config = uvicorn.Config(
            self.inflight_limit,
            http=_IdleBoundedHTTP,
            log_config=None,  # keep the sidecar's logging setup
            log_level=self.settings.log_level,
            access_log=self.settings.log_level == "debug",
            lifespan="off",
            # Not uvicorn's limit_concurrency: it counts idle connections (see InflightLimit).
            limit_concurrency=None,
            timeout_keep_alive=_IDLE_TIMEOUT_S,
            timeout_graceful_shutdown=2,
        )
        self._server = _EmbeddedServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="admin-api")
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if self._task.done():
                await self._task
                raise ConfigError(f"the admin API on {self.url} stopped during startup")
            if time.monotonic() > deadline:
                await self.stop()
                raise DeadlineExceeded(f"the admin API did not start within {timeout_s:.0f}s")
            await asyncio.sleep(0.01)
        log.info("admin API on %s", self.url)

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving (open connections get uvicorn's graceful shutdown) and detach metrics."""
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
            except TimeoutError:
                self._server.force_exit = True
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
        self.app.state.metrics.close()
        self._server = self._task = None
