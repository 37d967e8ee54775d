"""The P/D flows for one client request (DESIGN §2, README "Request flows").

1. The client's body goes to a decode instance with ``kv_transfer_params = {do_remote_prefill,
   transfer_id, router_url}``; decode's answer is the client's answer, relayed as it comes.
   Decode's connector posts its target to ``router_url`` once its blocks are allocated.
2. Concurrent (the default): the prompt goes to a prefill instance at the same time
   (``max_tokens=1``, not streamed, ``{do_remote_decode, transfer_id, router_url}``). Prefill
   computes at once; its connector fetches the target from ``router_url/<transfer_id>`` and
   its sidecar writes the layers computed so far, then the rest as they come. When decode's
   request ends the transfer id closes: a prefill still waiting for it is told so and frees
   its blocks, and one decode never gave a target to is cancelled.
3. Decode first: the prompt goes to prefill only once the target came, with it
   (``remote: target``). No target in time, or decode ended first: no prefill.
4. A failed prefill is only logged: decode's sidecar times out and decode recomputes. A
   client that goes away closes both upstream connections, which vLLM turns into aborts.
5. Decode alone (disagg.py): a short prompt, or one the picked decode mostly holds, goes to
   decode as a plain request and no prefill is asked; the record says ``local`` and why.
6. Tracing (README "Tracing"): the request's server span is a child of the client's
   ``traceparent`` (or starts a trace); each call to decode and prefill is a client span under
   it, whose traceparent goes upstream as the header and in ``kv_transfer_params``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

import anyio
import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.types import Receive

from app.proxy.balancer import Lease, Pool, is_connection_failure
from app.proxy.bodies import decode_body, is_streamed, local_body, prefill_body
from app.proxy.breaker import decode_ok
from app.proxy.config import Flow, ProxyConfig
from app.proxy.disagg import DisaggCounts
from app.proxy.errors import NoHealthyInstance, TargetError, error_response
from app.proxy.records import DecodeOutcome, TransferLog, TransferTracker
from app.proxy.routing import shape_of
from app.proxy.spans import TRACE_ID_HEADER, call_span, refused
from app.proxy.targets import TargetRendezvous
from app.tracing.otel import Span, Tracing
from app.tracing.otel import start as start_span
from app.tracing.traceparent import HEADER as TRACEPARENT
from app.tracing.traceparent import parse as parse_traceparent

log = logging.getLogger(__name__)

T = TypeVar("T")

# Passed on to the engines: vLLM's --api-key checks Authorization.
FORWARDED_HEADERS = ("authorization",)
TRANSFER_ID_HEADER = "x-kv-transfer-id"
# nginx's code for "the client closed the request"; nobody reads it, the log does.
CLIENT_GONE = 499


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


class _Exchange:
    """One client request: decode's lease and response, the prefill side task (None: decode
    alone), the record."""

    def __init__(
        self,
        tracker: TransferTracker,
        decode: Lease,
        prefill: asyncio.Task[None] | None,
        on_end: Callable[[DecodeOutcome], None],
        server: Span,
    ):
        self.tracker = tracker
        self.decode = decode
        self.prefill = prefill
        self.upstream: httpx.Response | None = None
        self.server = server  # the request's span; ``call``: the call to decode under it
        self.call: Span | None = None
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
        if self.prefill is not None and (outcome == "client_gone" or t.target_s is None):
            self.prefill.cancel()
        failure = None if outcome == "ok" else (error or outcome)
        for span in (self.call, self.server):
            if span is not None:
                span.set("http.response.status_code", t.decode_status)
                span.set("kv.outcome", outcome)
                span.end(failure)
        if self.upstream is not None:
            await self.upstream.aclose()


class PDFlow:
    """Routes completions requests to decode and prefill; owns the prefill side tasks."""

    def __init__(
        self,
        cfg: ProxyConfig,
        prefill: Pool,
        decode: Pool,
        targets: TargetRendezvous,
        transfers: TransferLog,
        client: httpx.AsyncClient,
    ) -> None:
        self.cfg = cfg
        self.prefill = prefill
        self.decode = decode
        self.targets = targets
        self.transfers = transfers
        self.client = client
        self._tasks: set[asyncio.Task[None]] = set()
        self._live: dict[str, TransferTracker] = {}  # by transfer id, until decode ended
        self.disagg = cfg.disagg_rules
        self.counts = DisaggCounts()
        self.tracing: Tracing | None = None  # the app's lifespan opens it when configured

    def target_arrived(self, transfer_id: str) -> None:
        """Decode posted its target (the rendezvous took it): note when."""
        t = self._live.get(transfer_id)
        if t is not None and t.target_s is None:
            t.target_s = t.since_start()

    async def handle(self, request: Request, path: str) -> Response:
        parent = parse_traceparent(request.headers.get(TRACEPARENT))
        server = start_span(
            self.tracing, f"POST {path}", parent, kind="server", attributes={"http.route": path}
        )
        body = await read_json_object(request)
        if isinstance(body, Response):
            return refused(server, body)
        shape = shape_of(body, path, self.cfg.prefix_block_size, self.cfg.max_model_len)
        try:
            d = self.decode.acquire(shape)
        except NoHealthyInstance as e:
            return refused(server, error_response(503, str(e), "service_unavailable"))
        # After decode's pick: whether decode holds the prompt depends on which decode it is.
        decision = self.disagg.decide(shape, d.pick)
        p: Lease | None = None
        if decision.disaggregated:
            try:
                p = self.prefill.acquire(shape)
            except NoHealthyInstance as e:
                d.release()
                return refused(server, error_response(503, str(e), "service_unavailable"))
        self.counts.count(decision)
        tid = uuid.uuid4().hex
        t = self.transfers.start(tid, path, d.url, None if p is None else p.url)
        t.decode_pick, t.reason = d.pick, decision.reason
        t.trace = server.traceparent
        server.set("kv.transfer_id", tid)
        headers = forwarded_headers(request)
        prefill: asyncio.Task[None] | None = None
        if p is not None:
            t.prefill_pick = p.pick
            # Open before decode hears of the id: its target may come back at once.
            self.targets.open(tid)
            self._live[tid] = t
            prefill = self._spawn_prefill(t, p, body, path, headers)
        else:
            log.debug("transfer %s: decode alone (%s)", tid, decision.reason)
        x = _Exchange(t, d, prefill, partial(self._decode_ended, t), server)
        disconnected = asyncio.create_task(until_disconnected(request.receive))
        try:
            return await self._answer(x, body, path, headers, disconnected)
        except asyncio.CancelledError:
            with anyio.CancelScope(shield=True):
                await x.end("client_gone")
            raise
        finally:
            # A streamed answer's disconnects are Starlette's to watch from here on.
            disconnected.cancel()
            await asyncio.gather(disconnected, return_exceptions=True)

    async def _answer(
        self,
        x: _Exchange,
        body: dict[str, Any],
        path: str,
        headers: dict[str, str],
        disconnected: asyncio.Task[None],
    ) -> Response:
        t = x.tracker
        call = x.call = call_span(self.tracing, t, "decode", x.decode.url, path)
        tp = call.traceparent.header
        req = self.client.build_request(
            "POST",
            f"{x.decode.url}{path}",
            json=(
                decode_body(body, t.transfer_id, self.cfg.router_url, tp)
                if t.disaggregated
                else local_body(body)
            ),
            headers={**headers, TRACEPARENT: tp},
        )
        try:
            upstream = await first_or_none(self.client.send(req, stream=True), disconnected)
        except httpx.HTTPError as e:
            return await self._decode_failed(x, e)
        if upstream is None:
            await x.end("client_gone")
            return Response(status_code=CLIENT_GONE)
        x.upstream = upstream
        t.decode_status = upstream.status_code
        out_headers = {TRANSFER_ID_HEADER: t.transfer_id, TRACE_ID_HEADER: x.server.trace_id}
        if "content-type" in upstream.headers:
            out_headers["content-type"] = upstream.headers["content-type"]
        if is_streamed(body):
            return StreamingResponse(
                self._relay(x),
                status_code=upstream.status_code,
                headers=out_headers,
                # Runs even when the client left before the first chunk was asked for.
                background=BackgroundTask(x.end, "client_gone"),
            )
        try:
            content = await first_or_none(upstream.aread(), disconnected)
        except httpx.HTTPError as e:
            return await self._decode_failed(x, e)
        if content is None:
            await x.end("client_gone")
            return Response(status_code=CLIENT_GONE)
        await x.end(*self._verdict(x))
        return Response(content, status_code=upstream.status_code, headers=out_headers)

    def _verdict(self, x: _Exchange) -> tuple[DecodeOutcome, str | None]:
        code = x.tracker.decode_status
        if code == 200:
            return "ok", None
        return "failed", f"decode instance {x.decode.url} answered {code}"

    async def _relay(self, x: _Exchange) -> AsyncIterator[bytes]:
        assert x.upstream is not None
        outcome: DecodeOutcome = "client_gone"  # unless the loop below ends on its own
        error: str | None = None
        try:
            async for chunk in x.upstream.aiter_bytes():
                yield chunk
            outcome, error = self._verdict(x)
        except httpx.HTTPError as e:
            outcome = "broken"
            error = f"decode instance {x.decode.url} broke off its answer: {describe(e)}"
            log.error("transfer %s: %s", x.tracker.transfer_id, error)
            if x.upstream.headers.get("content-type", "").startswith("text/event-stream"):
                # Headers are out; an error event is how vLLM itself reports this mid-stream.
                event = {"error": {"message": error, "type": "bad_gateway", "code": 502}}
                yield f"data: {json.dumps(event)}\n\n".encode()
        finally:
            # Shielded: on a disconnect this runs inside a cancelled scope.
            with anyio.CancelScope(shield=True):
                await x.end(outcome, error)

    async def _decode_failed(self, x: _Exchange, e: httpx.HTTPError) -> JSONResponse:
        url = x.decode.url
        outcome: DecodeOutcome
        if is_connection_failure(e):
            x.decode.instance.mark(False, f"connection failed: {describe(e)}")
            status, kind, outcome = 502, "bad_gateway", "unreachable"
            msg = f"decode instance {url} could not be reached: {describe(e)}"
        elif isinstance(e, httpx.TimeoutException):
            status, kind, outcome = 504, "gateway_timeout", "timeout"
            msg = (
                f"decode instance {url} did not answer within "
                f"{self.cfg.request_timeout_s:g} s: {describe(e)}"
            )
        else:
            status, kind, outcome = 502, "bad_gateway", "broken"
            msg = f"decode instance {url} failed: {describe(e)}"
        log.error("transfer %s: %s", x.tracker.transfer_id, msg)
        await x.end(outcome, msg)
        answer = error_response(status, msg, kind)
        # The id the proxy's and both sidecars' records know, for the operator's curl.
        answer.headers[TRANSFER_ID_HEADER] = x.tracker.transfer_id
        answer.headers[TRACE_ID_HEADER] = x.server.trace_id
        return answer

    def _decode_ended(self, t: TransferTracker, outcome: DecodeOutcome) -> None:
        self._live.pop(t.transfer_id, None)
        if self.cfg.flow is Flow.CONCURRENT:
            # Prefill's connector may still wait for the target: it hears why it will not come.
            self.targets.close(t.transfer_id, f"decode's request ended ({outcome})")
            if t.target_s is None and t.prefill_outcome == "ok":
                t.prefill_outcome = "no_target"  # it computed, but nothing was sent

    def _spawn_prefill(
        self,
        t: TransferTracker,
        p: Lease,
        body: dict[str, Any],
        path: str,
        headers: dict[str, str],
    ) -> asyncio.Task[None]:
        concurrent = self.cfg.flow is Flow.CONCURRENT
        run = self._prefill_now if concurrent else self._prefill
        task = asyncio.create_task(run(t, p, body, path, headers))
        self._tasks.add(task)

        def done(task: asyncio.Task[None]) -> None:
            # Here, not in _prefill: a task cancelled before it ran never enters its body.
            self._tasks.discard(task)
            p.release()
            if not concurrent:  # concurrent: prefill may end before decode's target came
                self.targets.close(t.transfer_id, "its request already ended")
            if t.prefill_outcome is None:
                t.prefill_outcome = "no_target" if t.target_s is None else "cancelled"
            if not task.cancelled() and task.exception() is not None:
                log.error(
                    "transfer %s: prefill side crashed", t.transfer_id, exc_info=task.exception()
                )

        task.add_done_callback(done)
        return task

    async def _prefill(
        self,
        t: TransferTracker,
        p: Lease,
        body: dict[str, Any],
        path: str,
        headers: dict[str, str],
    ) -> None:
        tid, timeout = t.transfer_id, self.cfg.target_timeout_s
        try:
            target = await self.targets.wait(tid, timeout)
        except TimeoutError:
            t.prefill_outcome = "target_timeout"
            msg = f"no target from decode {t.decode} within {timeout:g} s; prefill skipped"
            t.note_error(msg)
            log.warning("transfer %s: %s (decode computes the prompt itself)", tid, msg)
            self.targets.close(tid, f"no target came within {timeout:g} s")
            return
        except TargetError as e:
            t.prefill_outcome = "target_error"
            t.note_error(str(e))
            log.warning("transfer %s: %s", tid, e)
            return
        t.target_s = t.since_start()
        self.targets.close(tid, "its target already arrived")
        call = call_span(self.tracing, t, "prefill", p.url, path)
        out = prefill_body(body, tid, target=target, traceparent=call.traceparent.header)
        await self._post_prefill(t, p, out, path, headers, call)

    async def _prefill_now(
        self,
        t: TransferTracker,
        p: Lease,
        body: dict[str, Any],
        path: str,
        headers: dict[str, str],
    ) -> None:
        """Concurrent: the prompt goes to prefill at once; its connector fetches the target."""
        tid = t.transfer_id
        call = call_span(self.tracing, t, "prefill", p.url, path)
        out = prefill_body(
            body,
            tid,
            router_url=self.cfg.router_url,
            target_timeout_s=self.cfg.target_timeout_s,
            traceparent=call.traceparent.header,
        )
        await self._post_prefill(t, p, out, path, headers, call)

    async def _post_prefill(
        self,
        t: TransferTracker,
        p: Lease,
        out: dict[str, Any],
        path: str,
        headers: dict[str, str],
        call: Span,
    ) -> None:
        """The call to prefill, timed by ``call`` (ended however the call ends)."""
        try:
            await self._send_prefill(
                t, p, out, path, {**headers, TRACEPARENT: call.traceparent.header}
            )
        finally:
            call.set("http.response.status_code", t.prefill_status)
            call.set("kv.outcome", t.prefill_outcome or "cancelled")
            call.end(None if t.prefill_outcome == "ok" else (t.prefill_outcome or "cancelled"))

    async def _send_prefill(
        self,
        t: TransferTracker,
        p: Lease,
        out: dict[str, Any],
        path: str,
        headers: dict[str, str],
    ) -> None:
        tid = t.transfer_id
        t0 = time.monotonic()
        try:
            r = await self.client.post(f"{p.url}{path}", json=out, headers=headers)
        except httpx.HTTPError as e:
            if is_connection_failure(e):
                p.instance.mark(False, f"connection failed: {describe(e)}")
            t.prefill_outcome = "prefill_failed"
            msg = f"prefill instance {p.url} failed: {describe(e)}"
            p.settle(False, msg)
            t.note_error(msg)
            log.error("transfer %s: %s (decode recomputes after its sidecar gives up)", tid, msg)
            return
        finally:
            t.prefill_s = time.monotonic() - t0
        t.prefill_status = r.status_code
        p.settle(r.status_code < 500, f"answered {r.status_code}")
        if r.status_code == 200:
            t.prefill_outcome = "ok"
            return
        t.prefill_outcome = "prefill_failed"
        msg = f"prefill instance {p.url} answered {r.status_code}: {r.text[:300]}"
        t.note_error(msg)
        log.error("transfer %s: %s", tid, msg)

    async def close(self) -> None:
        """Cut off every prefill still running (shutdown)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
