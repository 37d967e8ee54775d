"""One client request's state on each side (decode's ``Exchange``, prefill's ``PrefillJob``)
and the request helpers the flow and the app share."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.types import Receive

from app.proxy.balancer import Lease
from app.proxy.breaker import decode_ok
from app.proxy.errors import error_response
from app.proxy.records import DecodeOutcome, TransferTracker
from app.proxy.retries import Retry
from app.tracing.otel import Span

T = TypeVar("T")

# Passed on to the engines: vLLM's --api-key checks Authorization.
FORWARDED_HEADERS = ("authorization",)


def describe(e: BaseException) -> str:
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def forwarded_headers(request: Request) -> dict[str, str]:
    return {k: v for k in FORWARDED_HEADERS if (v := request.headers.get(k)) is not None}


async def read_json_object(request: Request) -> dict[str, Any] | JSONResponse:
    """The body as a JSON object, or the 400 to answer."""
    try:
        body = await request.json()
    except ValueError:
        return error_response(400, "request body is not valid JSON", "invalid_request_error")
    if not isinstance(body, dict):
        return error_response(400, "request body must be a JSON object", "invalid_request_error")
    return body


async def until_disconnected(receive: Receive) -> None:
    """Returns when the client closes its connection (its body was already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def first_or_none(aw: Awaitable[T], disconnected: asyncio.Task[None]) -> T | None:
    """``aw``'s result, or None if the client went away first (``aw`` is then cancelled)."""
    task = asyncio.ensure_future(aw)
    try:
        await asyncio.wait({task, disconnected}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            # Cancelling an httpx call closes its connection: that is what aborts upstream.
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return None if task.cancelled() else task.result()


@dataclass(frozen=True)
class PrefillJob:
    """One request's prefill side: its record, prefill's lease, and what the call carries."""

    tracker: TransferTracker
    lease: Lease
    body: dict[str, Any]
    path: str
    headers: dict[str, str]  # forwarded from the client
    token: str  # the transfer's (bodies.TRANSFER_TOKEN_PARAM)
    prompt_ids: tuple[int, ...] | None = None  # a chat request's rendered ids (chat_tokens.py)


class Exchange:
    """One client request: decode's lease and response, the prefill side task (None: decode
    alone), the record, and the transfer's token (None: decode alone)."""

    def __init__(
        self,
        tracker: TransferTracker,
        decode: Lease,
        prefill: asyncio.Task[None] | None,
        on_end: Callable[[DecodeOutcome], None],
        server: Span,
        token: str | None,
    ):
        self.tracker = tracker
        self.decode = decode
        self.prefill = prefill
        self.token = token
        self.upstream: httpx.Response | None = None
        self.server = server  # the request's span; ``call``: the call to decode under it
        self.call: Span | None = None
        self.retry: Retry | None = None  # decode failed and the request goes again (flow.py)
        self._on_end = on_end
        self._ended = False

    async def end(self, outcome: DecodeOutcome, error: str | None = None) -> None:
        """Decode's side is over (idempotent: the first caller's outcome counts)."""
        if self._ended:
            return
        self._ended = True
        t = self.tracker
        t.decode_outcome = outcome
        t.total_s = t.since_start()
        if error is not None:
            t.note_error(error)
        self.decode.settle(decode_ok(outcome, t.decode_status), error or "")
        self.decode.release()
        self._on_end(outcome)
        # A prefill for a decode that never gave a target is pointless now. One that had it
        # is left to finish when decode answered (it is about done), and cut off if the
        # client left.
        # A retried one's prefill fed a decode that failed: the retry has a prefill of its own.
        cut = outcome == "client_gone" or t.target_s is None or t.retried_as is not None
        if self.prefill is not None and cut:
            self.prefill.cancel()
        failure = None if outcome == "ok" else (error or outcome)
        # A retried request's server span goes on: the retry's exchange ends it.
        spans = (self.call,) if t.retried_as is not None else (self.call, self.server)
        for span in spans:
            if span is not None:
                span.set("http.response.status_code", t.decode_status)
                span.set("kv.outcome", outcome)
                span.end(failure)
        if self.upstream is not None:
            await self.upstream.aclose()
