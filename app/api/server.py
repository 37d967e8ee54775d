"""The admin API (DESIGN §8): FastAPI on uvicorn, inside the sidecar's own event loop.

Handlers are ``async def`` on purpose: they then run on the loop that owns every request and
counter, read a consistent snapshot without locks, and never wait on a transfer. The one mutating
call, abort, goes through the sidecar like an engine's abort would.

The routes are in ``app.api.routes``, one router per resource; ``create_app`` gives them the
sidecar through ``app.state`` and puts the admin token check on the mutating ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

try:  # what uvicorn's "auto" picks when it is installed
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _HTTPProtocol
except ImportError:  # pragma: no cover - h11 always ships with uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol as _HTTPProtocol  # type: ignore[assignment]

from app.api import views
from app.api.deps import admin_only, admin_token
from app.api.guards import BodyLimit, InflightLimit
from app.api.metrics import SidecarMetrics
from app.api.routes import digest, groups, health, peers, pool, requests, status, targets
from app.api.routes import metrics as metrics_routes
from app.config import SidecarSettings, env_var_for
from app.errors import ConfigError, DeadlineExceeded
from app.transfer.sidecar.process import Sidecar

log = logging.getLogger(__name__)

_TICK_S = 1.0  # the Date header's resolution (uvicorn's own)

# Probes and scrapes are small; past this many requests in flight the API answers 503 instead of
# queueing work on the loop that also runs the control plane.
_MAX_INFLIGHT = 64
# An idle connection (before its first request or between requests) is closed after this long.
_IDLE_TIMEOUT_S = 5
# A body (a target, an abort reason) is a few KiB and comes in one packet: a client still
# sending after this long is stuck or hostile, and holds a slot of the write limit meanwhile.
_BODY_TIMEOUT_S = 10.0


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
    app.state.sidecar = sidecar
    app.state.metrics = SidecarMetrics(sidecar)
    app.state.admin_token = admin_token(settings)
    # In this order, the OpenAPI lists the paths as it always has.
    app.include_router(health.router)
    app.include_router(metrics_routes.router)
    app.include_router(status.router)
    app.include_router(groups.router)
    app.include_router(requests.router)
    app.include_router(requests.admin_router, **admin_only(settings))
    app.include_router(targets.router)
    app.include_router(peers.router)
    app.include_router(pool.router)
    app.include_router(digest.router)
    app.include_router(digest.admin_router, **admin_only(settings))
    return app


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
    """uvicorn without its signal handlers (the sidecar's process owns SIGTERM/SIGINT) and
    without its 10 Hz tick: the tick refreshes the Date header once a second and checks
    ``should_exit``, yet woke an idle sidecar's loop ten times a second (2 of its 5.5 ms of
    CPU a second, measured). Here it runs once a second, and setting ``should_exit`` wakes it."""

    def __init__(self, config: uvicorn.Config) -> None:
        self._exit = asyncio.Event()
        super().__init__(config)

    @property
    def should_exit(self) -> bool:
        return self._exit.is_set()

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        if value:
            self._exit.set()
        else:
            self._exit.clear()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def main_loop(self) -> None:
        # Counter 0: uvicorn refreshes the Date header on every tenth tick, here on each.
        while not await self.on_tick(0):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exit.wait(), _TICK_S)


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
