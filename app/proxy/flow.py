"""The P/D flows for one client request (DESIGN §2, README "Request flows").

1. The client's body goes to a decode instance with ``kv_transfer_params = {do_remote_prefill,
   transfer_id, router_url, transfer_token}``; decode's answer is the client's answer, relayed
   as it comes.
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
   decode as a plain request and no prefill is asked; the record says ``local`` and why. So
   does one that needs a prefill when none is available (``--without-prefill``), counted in
   ``kvproxy_prefill_unavailable_total``.
6. Each disaggregated transfer has a secret token (bodies.py) in both bodies'
   ``kv_transfer_params``; the connectors send it back on ``/v1/kv_targets`` (targets.py).
7. Tracing (README "Tracing"): the request's server span is a child of the client's
   ``traceparent`` (or starts a trace); each call to decode and prefill is a client span under
   it, whose traceparent goes upstream as the header and in ``kv_transfer_params``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import anyio
import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from app.proxy.balancer import Pool, is_connection_failure
from app.proxy.bodies import (
    decode_body,
    is_streamed,
    kv_load_of,
    local_body,
    new_transfer_token,
    prefill_body,
)
from app.proxy.config import Flow, ProxyConfig, WithoutPrefill
from app.proxy.disagg import Decision, DisaggCounts, without_prefill
from app.proxy.dp import upstream as dp_upstream
from app.proxy.errors import NoHealthyInstance, TargetError, error_response
from app.proxy.exchange import (
    Exchange,
    PrefillJob,
    describe,
    first_or_none,
    forwarded_headers,
    read_json_object,
    until_disconnected,
)
from app.proxy.metrics import REFUSED, ProxyMetrics
from app.proxy.pool_tier import PoolTier
from app.proxy.records import DecodeOutcome, TransferLog, TransferTracker
from app.proxy.routing import shape_of
from app.proxy.spans import TRACE_ID_HEADER, call_span, refused
from app.proxy.targets import TargetRendezvous
from app.tracing.otel import Span, Tracing
from app.tracing.otel import start as start_span
from app.tracing.traceparent import HEADER as TRACEPARENT
from app.tracing.traceparent import parse as parse_traceparent

log = logging.getLogger(__name__)

TRANSFER_ID_HEADER = "x-kv-transfer-id"
# nginx's code for "the client closed the request"; nobody reads it, the log does.
CLIENT_GONE = 499
NO_PREFILL_LOG_INTERVAL_S = 10.0


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
        metrics: ProxyMetrics,
    ) -> None:
        self.cfg = cfg
        self.prefill = prefill
        self.decode = decode
        self.targets = targets
        self.transfers = transfers
        self.client = client
        self.metrics = metrics
        self._tasks: set[asyncio.Task[None]] = set()
        self._live: dict[str, TransferTracker] = {}  # by transfer id, until decode ended
        self.disagg = cfg.disagg_rules
        self.counts = DisaggCounts()
        self._no_prefill_logged = float("-inf")  # monotonic time of the last such warning
        self.tracing: Tracing | None = None  # the app's lifespan opens it when configured
        # The KV pool as the prefill pick's second tier (pool_tier.py).
        self.pool_tier = (
            None
            if cfg.pool_lookup is None
            else PoolTier(
                cfg.pool_lookup,
                client,
                cfg.pool_load_cost,
                cfg.pool_lookup_timeout_s,
                cfg.pool_lookup_token,
            )
        )

    def _warn_no_prefill(self, reason: str) -> None:
        # At most one line per interval: with every prefill down, each long prompt comes here.
        now = time.monotonic()
        if now - self._no_prefill_logged >= NO_PREFILL_LOG_INTERVAL_S:
            self._no_prefill_logged = now
            log.warning("%s (kvproxy_prefill_unavailable_total counts them)", reason)

    def target_arrived(self, transfer_id: str) -> None:
        """Decode posted its target (the rendezvous took it): note when."""
        t = self._live.get(transfer_id)
        if t is not None and t.target_s is None:
            t.target_s = t.since_start()

    def _refuse(
        self, server: Span, path: str, decision: Decision | None, answer: Response
    ) -> Response:
        self.metrics.request(path, decision, REFUSED)
        return refused(server, answer)

    async def handle(self, request: Request, path: str) -> Response:
        parent = parse_traceparent(request.headers.get(TRACEPARENT))
        server = start_span(
            self.tracing, f"POST {path}", parent, kind="server", attributes={"http.route": path}
        )
        body = await read_json_object(request)
        if isinstance(body, Response):
            return self._refuse(server, path, None, body)
        shape = shape_of(body, path, self.cfg.prefix_block_size, self.cfg.max_model_len)
        try:
            d = self.decode.acquire(shape)
        except NoHealthyInstance as e:
            answer = error_response(503, str(e), "service_unavailable")
            return self._refuse(server, path, None, answer)
        self.metrics.pick("decode", d.pick)
        # After decode's pick: whether decode holds the prompt depends on which decode it is.
        decision = self.disagg.decide(shape, d.pick)
        p = None
        if decision.disaggregated:
            tier = None
            if self.pool_tier is not None and self.prefill.any_available:
                # Not for a pick that cannot happen: the lookup would only delay the answer.
                tier = await self.pool_tier.lookup(shape)
            try:
                p = self.prefill.acquire(shape, tier)
            except NoHealthyInstance as e:
                if self.cfg.without_prefill is WithoutPrefill.REFUSE:
                    self.metrics.prefill_unavailable("refused")
                    d.release()
                    answer = error_response(503, str(e), "service_unavailable")
                    return self._refuse(server, path, decision, answer)
                self.metrics.prefill_unavailable("decode_alone")
                decision = without_prefill(decision, str(e))
                self._warn_no_prefill(decision.reason)
            else:
                self.metrics.pick("prefill", p.pick)
        self.counts.count(decision)
        tid = uuid.uuid4().hex
        t = self.transfers.start(tid, path, d.url, None if p is None else p.url)
        t.decode_pick, t.reason = d.pick, decision.reason
        t.trace = server.traceparent
        server.set("kv.transfer_id", tid)
        headers = forwarded_headers(request)
        prefill: asyncio.Task[None] | None = None
        token: str | None = None
        if p is not None:
            t.prefill_pick = p.pick
            token = new_transfer_token()
            # Open before decode hears of the id: its target may come back at once.
            self.targets.open(tid, token)
            self._live[tid] = t
            prefill = self._spawn_prefill(PrefillJob(t, p, body, path, headers, token))
        else:
            log.debug("transfer %s: decode alone (%s)", tid, decision.reason)
        x = Exchange(t, d, prefill, partial(self._decode_ended, t, decision), server, token)
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
        x: Exchange,
        body: dict[str, Any],
        path: str,
        headers: dict[str, str],
        disconnected: asyncio.Task[None],
    ) -> Response:
        t = x.tracker
        call = x.call = call_span(self.tracing, t, "decode", x.decode.url, path)
        tp = call.traceparent.header
        base, rank = dp_upstream(x.decode.url)
        req = self.client.build_request(
            "POST",
            f"{base}{path}",
            json=(
                local_body(body)
                if x.token is None
                else decode_body(body, t.transfer_id, self.cfg.router_url, x.token, tp)
            ),
            headers={**headers, **rank, TRACEPARENT: tp},
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
            # Whether decode loaded the KV is in its last event, not read here: kv_load
            # stays None and a recompute shows as ok.
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
        if t.disaggregated and upstream.status_code == 200:
            t.kv_load = kv_load_of(content)
        await x.end(*self._verdict(x))
        return Response(content, status_code=upstream.status_code, headers=out_headers)

    def _verdict(self, x: Exchange) -> tuple[DecodeOutcome, str | None]:
        code = x.tracker.decode_status
        if code == 200:
            return "ok", None
        return "failed", f"decode instance {x.decode.url} answered {code}"

    async def _relay(self, x: Exchange) -> AsyncIterator[bytes]:
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

    async def _decode_failed(self, x: Exchange, e: httpx.HTTPError) -> JSONResponse:
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

    def _decode_ended(self, t: TransferTracker, decision: Decision, outcome: DecodeOutcome) -> None:
        self._live.pop(t.transfer_id, None)
        if self.cfg.flow is Flow.CONCURRENT:
            # Prefill's connector may still wait for the target: it hears why it will not come.
            self.targets.close(t.transfer_id, f"decode's request ended ({outcome})")
            if t.target_s is None and t.prefill_outcome == "ok":
                t.prefill_outcome = "no_target"  # it computed, but nothing was sent
        self.metrics.request(t.path, decision, outcome)
        self._count_settled(t)

    def _count_settled(self, t: TransferTracker) -> None:
        """Count the record's final status once both sides ended (either may end last)."""
        if not t.counted and t.status != "pending":
            t.counted = True
            self.metrics.transfer(t.status)

    def _spawn_prefill(self, job: PrefillJob) -> asyncio.Task[None]:
        concurrent = self.cfg.flow is Flow.CONCURRENT
        run = self._prefill_now if concurrent else self._prefill
        task = asyncio.create_task(run(job))
        self._tasks.add(task)
        t = job.tracker

        def done(task: asyncio.Task[None]) -> None:
            # Here, not in _prefill: a task cancelled before it ran never enters its body.
            self._tasks.discard(task)
            job.lease.release()
            if not concurrent:  # concurrent: prefill may end before decode's target came
                self.targets.close(t.transfer_id, "its request already ended")
            if t.prefill_outcome is None:
                t.prefill_outcome = "no_target" if t.target_s is None else "cancelled"
            self._count_settled(t)
            if not task.cancelled() and task.exception() is not None:
                log.error(
                    "transfer %s: prefill side crashed", t.transfer_id, exc_info=task.exception()
                )

        task.add_done_callback(done)
        return task

    async def _prefill(self, job: PrefillJob) -> None:
        """Decode first: the prompt goes to prefill once decode's target came, with it."""
        t = job.tracker
        tid, timeout = t.transfer_id, self.cfg.target_timeout_s
        try:
            stages = await self.targets.wait(tid, timeout)
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
        call = call_span(self.tracing, t, "prefill", job.lease.url, job.path)
        out = prefill_body(
            job.body, tid, token=job.token, targets=stages, traceparent=call.traceparent.header
        )
        await self._post_prefill(job, out, call)

    async def _prefill_now(self, job: PrefillJob) -> None:
        """Concurrent: the prompt goes to prefill at once; its connector fetches the target."""
        t = job.tracker
        call = call_span(self.tracing, t, "prefill", job.lease.url, job.path)
        out = prefill_body(
            job.body,
            t.transfer_id,
            token=job.token,
            router_url=self.cfg.router_url,
            target_timeout_s=self.cfg.target_timeout_s,
            traceparent=call.traceparent.header,
        )
        await self._post_prefill(job, out, call)

    async def _post_prefill(self, job: PrefillJob, out: dict[str, Any], call: Span) -> None:
        """The call to prefill, timed by ``call`` (ended however the call ends)."""
        t = job.tracker
        try:
            await self._send_prefill(
                job, out, {**job.headers, TRACEPARENT: call.traceparent.header}
            )
        finally:
            call.set("http.response.status_code", t.prefill_status)
            call.set("kv.outcome", t.prefill_outcome or "cancelled")
            call.end(None if t.prefill_outcome == "ok" else (t.prefill_outcome or "cancelled"))

    async def _send_prefill(
        self, job: PrefillJob, out: dict[str, Any], headers: dict[str, str]
    ) -> None:
        t, p = job.tracker, job.lease
        tid = t.transfer_id
        t0 = time.monotonic()
        try:
            base, rank = dp_upstream(p.url)
            r = await self.client.post(f"{base}{job.path}", json=out, headers={**headers, **rank})
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
