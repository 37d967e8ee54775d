"""ASGI guards in front of the admin API and the proxy: requests in flight and request bodies
are bounded.

``InflightLimit`` answers 503 past a number of requests in flight, counted apart for reads and
for writes (requests that carry a body), so that clients sending bodies slowly never starve the
status pages; health probes are never limited. ``BodyLimit`` reads a body whole before the app
sees it: larger than the cap is 413, slower than the deadline is 408. Both answer through a
``Respond`` hook, so each server keeps its own error shape.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from fastapi.responses import JSONResponse
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.transfer.control.framing import LogThrottle

log = logging.getLogger(__name__)

# Never limited: a sidecar busy serving its API is still alive and ready, and a probe that fails
# under load gets a healthy process restarted or taken out of service.
HEALTH_PATHS = ("/livez", "/readyz")
_WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_OVERLOAD_LOG_INTERVAL_S = 5.0

Respond = Callable[[int, str], Response]
"""Builds the answer to a refused request from its status and a sentence."""


def detail(status: int, message: str) -> Response:
    """FastAPI's own error shape, ``{"detail": message}``."""
    return JSONResponse({"detail": message}, status)


class InflightLimit:
    """503 past ``limit`` reads or ``limit`` writes in flight, except for paths that start
    with one of ``exempt``.

    uvicorn's own ``limit_concurrency`` counts open connections, idle keep-alive ones included:
    63 idle sockets turned /livez into 503 for as long as they stayed open. This counts requests.
    """

    def __init__(
        self,
        app: ASGIApp,
        limit: int,
        exempt: tuple[str, ...] = HEALTH_PATHS,
        respond: Respond = detail,
    ) -> None:
        self._app = app
        self._limit = limit
        self._exempt = exempt
        self._respond = respond
        self._inflight = {"read": 0, "write": 0}
        self._throttle = LogThrottle(_OVERLOAD_LOG_INTERVAL_S)
        self.refused = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith(self._exempt):
            await self._app(scope, receive, send)
            return
        kind = "write" if scope["method"] in _WRITES else "read"
        if self._inflight[kind] >= self._limit:
            self.refused += 1
            self._log_refusal(kind)
            answer = self._respond(503, f"{self._inflight[kind]} {kind}s in flight; retry")
            answer.headers["Retry-After"] = "1"
            await answer(scope, receive, send)
            return
        self._inflight[kind] += 1
        try:
            await self._app(scope, receive, send)
        finally:
            self._inflight[kind] -= 1

    def _log_refusal(self, kind: str) -> None:
        # One line per interval: whoever overloads the API must not flood the log as well.
        held = self._throttle.allow()
        if held is None:
            return
        log.warning(
            "%d %ss in flight, answered 503 (%d more since the last line)",
            self._inflight[kind],
            kind,
            held,
        )


class BodyLimit:
    """Reads each request body whole, at most ``max_bytes`` within ``timeout_s``, then hands
    the app a body that is already there (the app never waits on a slow client)."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        timeout_s: float,
        setting: str = "admin_max_body_bytes",
        respond: Respond = detail,
    ) -> None:
        self._app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self._setting = setting  # named in the 413's sentence: what an operator would raise
        self._respond = respond

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, receive, send, 413, f"a body of {declared} bytes")
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        body = bytearray()
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except TimeoutError:
                why = f"the body did not arrive within {self.timeout_s:g} s"
                await self._refuse(scope, receive, send, 408, why)
                return
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self._refuse(scope, receive, send, 413, f"over {len(body) - 1} bytes")
                return
            if not message.get("more_body", False):
                break
        given = False

        async def replay() -> Message:
            nonlocal given
            if given:
                return await receive()
            given = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self._app(scope, replay, send)

    async def _refuse(
        self, scope: Scope, receive: Receive, send: Send, code: int, what: str
    ) -> None:
        if code == 413:
            message = f"{what}: expected at most {self.max_bytes} bytes ({self._setting})"
        else:
            message = f"{what}; send the whole body at once"
        answer = self._respond(code, message)
        # The connection is closed after the answer: the rest of the body is never read.
        answer.headers["Connection"] = "close"
        await answer(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
