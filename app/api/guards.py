"""ASGI guards in front of the admin API: requests in flight and request bodies are bounded.

``InflightLimit`` answers 503 past a number of requests in flight, counted apart for reads and
for writes (requests that carry a body), so that clients sending bodies slowly never starve the
status pages; health probes are never limited. ``BodyLimit`` reads a body whole before the app
sees it: larger than the cap is 413, slower than the deadline is 408.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.transfer.control import LogThrottle

log = logging.getLogger(__name__)

# Never limited: a sidecar busy serving its API is still alive and ready, and a probe that fails
# under load gets a healthy process restarted or taken out of service.
HEALTH_PATHS = frozenset({"/livez", "/readyz"})
_WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_OVERLOAD_LOG_INTERVAL_S = 5.0


class InflightLimit:
    """503 past ``limit`` reads or ``limit`` writes in flight, except for ``HEALTH_PATHS``.

    uvicorn's own ``limit_concurrency`` counts open connections, idle keep-alive ones included:
    63 idle sockets turned /livez into 503 for as long as they stayed open. This counts requests.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self._app = app
        self._limit = limit
        self._inflight = {"read": 0, "write": 0}
        self._throttle = LogThrottle(_OVERLOAD_LOG_INTERVAL_S)
        self.refused = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in HEALTH_PATHS:
            await self._app(scope, receive, send)
            return
        kind = "write" if scope["method"] in _WRITES else "read"
        if self._inflight[kind] >= self._limit:
            self.refused += 1
            self._log_refusal(kind)
            body = {"detail": f"the admin API has {self._inflight[kind]} {kind}s in flight; retry"}
            await JSONResponse(body, 503, headers={"Retry-After": "1"})(scope, receive, send)
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
            "admin API: %d %ss in flight, answered 503 (%d more since the last line)",
            self._inflight[kind],
            kind,
            held,
        )


class BodyLimit:
    """Reads each request body whole, at most ``max_bytes`` within ``timeout_s``, then hands
    the app a body that is already there (the app never waits on a slow client)."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self._app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

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
            detail = f"{what}: expected at most {self.max_bytes} bytes (admin_max_body_bytes)"
        else:
            detail = f"{what}; send the whole body at once"
        # The connection is closed after the answer: the rest of the body is never read.
        headers = {"Connection": "close"}
        await JSONResponse({"detail": detail}, code, headers=headers)(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
