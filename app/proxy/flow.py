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
4. Failures (prefill_side.py, retries.py). A prefill the prompt never reached is retried once
   for the same transfer on another prefill. One that failed for good is told to decode's
   sidecar (``--decode-sidecar``, decode_stop.py): decode recomputes now, not at its
   deadline. A decode that failed before the client got a byte (refused, reset, 5xx; a
   stream's first chunk is read before the client's headers go out) is retried once as a new
   transfer on another decode; after the first byte a stream goes on from another decode
   with the tokens the client has (migration.py, ``--migration-limit``), or ends with an
   error event when it cannot. Both within the retry budget; the records say ``attempts`` and
   why. A client that goes away closes both upstream connections, which vLLM turns into aborts.
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
import logging
import time
import uuid
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
    kv_load_error_of,
    kv_load_of,
    local_body,
    new_transfer_token,
)
from app.proxy.chat_tokens import ChatPrompt, ChatTokens, Fallback
from app.proxy.config import Flow, ProxyConfig, WithoutPrefill
from app.proxy.decode_stop import DecodeStopper
from app.proxy.disagg import Decision, DisaggCounts, without_prefill
from app.proxy.dp import upstream as dp_upstream
from app.proxy.errors import NoHealthyInstance, error_response
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
from app.proxy.migration import Stitch, refusal, with_token_ids
from app.proxy.pool_tier import PoolTier
from app.proxy.prefill_side import PrefillSide
from app.proxy.records import DecodeOutcome, TransferLog, TransferTracker
from app.proxy.resume import relay
from app.proxy.retries import Reason, Retry, RetryBudget
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


def _chat_note(chat: ChatPrompt | Fallback | None) -> str | None:
    """The record's ``chat_tokens``."""
    if chat is None:
        return None
    if isinstance(chat, Fallback):
        return f"text: {chat.reason}: {chat.detail}"
    return f"ids from {chat.source}"


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
        self._live: dict[str, TransferTracker] = {}  # by transfer id, until decode ended
        self.disagg = cfg.disagg_rules
        self.counts = DisaggCounts()
        self._no_prefill_logged = float("-inf")  # monotonic time of the last such warning
        self.budget = RetryBudget(cfg.retry_budget)
        stopper = DecodeStopper(cfg, client)
        self.prefills = PrefillSide(
            cfg, prefill, targets, client, metrics, self.budget, self._count_settled, stopper
        )
        self._tracing: Tracing | None = None  # the app's lifespan opens it when configured
        # Chat messages rendered to ids by a decode instance (chat_tokens.py).
        self.chat_tokens = (
            ChatTokens(
                client,
                lambda: [i.url for i in decode.instances if i.available],
                cfg.chat_token_settings,
            )
            if cfg.chat_tokens
            else None
        )
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

    @property
    def tracing(self) -> Tracing | None:
        return self._tracing

    @tracing.setter
    def tracing(self, tracing: Tracing | None) -> None:
        self._tracing = self.prefills.tracing = tracing

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

    async def _chat_prompt(
        self, body: dict[str, Any], path: str, headers: dict[str, str]
    ) -> ChatPrompt | Fallback | None:
        """A chat request's ids as vLLM renders them, or why it is routed as text; None: not
        a chat request, or chat tokens are off."""
        if self.chat_tokens is None or "chat" not in path:
            return None
        got = await self.chat_tokens.prompt(body, headers)
        if isinstance(got, Fallback):
            self.metrics.chat_prompt("text", got.reason, got.call_s)
            log.debug("chat request routed as text (%s): %s", got.reason, got.detail)
        else:
            self.metrics.chat_prompt(got.source, None, got.call_s)
        return got

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
        self.budget.request()
        headers = forwarded_headers(request)
        chat = await self._chat_prompt(body, path, headers)
        stitch = self._stitch(body, path, chat)
        disconnected = asyncio.create_task(until_disconnected(request.receive))
        try:
            retries: tuple[Retry, ...] = ()
            tid: str | None = None
            while True:  # at most twice: a decode retry is made once (_decode_retry)
                x = await self._start(server, body, path, headers, retries, tid, chat)
                if isinstance(x, Response):
                    return x
                try:
                    answer = await self._answer(x, body, path, headers, disconnected, chat, stitch)
                except asyncio.CancelledError:
                    with anyio.CancelScope(shield=True):
                        await x.end("client_gone")
                    raise
                if isinstance(answer, Response):
                    return answer
                # Decode failed before the client got a byte: again, as a new transfer.
                assert x.retry is not None
                retries, tid = (*x.tracker.retries, x.retry), x.tracker.retried_as
        finally:
            # A streamed answer's disconnects are Starlette's to watch from here on.
            disconnected.cancel()
            await asyncio.gather(disconnected, return_exceptions=True)

    async def _start(
        self,
        server: Span,
        body: dict[str, Any],
        path: str,
        headers: dict[str, str],
        retries: tuple[Retry, ...],
        tid: str | None,
        chat: ChatPrompt | Fallback | None,
        exclude: frozenset[str] | None = None,
    ) -> Exchange | Response:
        """Pick decode (and prefill), open the transfer and start prefill's side; a decode
        retry (``retries`` ends with one) excludes the decode instances that failed, unless
        ``exclude`` names those to exclude."""
        ids = chat.ids if isinstance(chat, ChatPrompt) else None
        shape = shape_of(body, path, self.cfg.prefix_block_size, self.cfg.max_model_len, ids)
        failed = frozenset(r.instance for r in retries if r.stage == "decode")
        failed = failed if exclude is None else exclude
        try:
            d = self.decode.acquire(shape, exclude=failed)
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
        tid = tid or uuid.uuid4().hex
        t = self.transfers.start(tid, path, d.url, None if p is None else p.url)
        t.decode_pick, t.reason = d.pick, decision.reason
        t.trace = server.traceparent
        t.retries = retries
        t.chat_tokens = _chat_note(chat)
        server.set("kv.transfer_id", tid)
        prefill: asyncio.Task[None] | None = None
        token: str | None = None
        if p is not None:
            t.prefill_pick = p.pick
            token = new_transfer_token()
            # Open before decode hears of the id: its target may come back at once.
            self.targets.open(tid, token)
            self._live[tid] = t
            prefill = self.prefills.spawn(PrefillJob(t, p, body, path, headers, token, ids))
        else:
            log.debug("transfer %s: decode alone (%s)", tid, decision.reason)
        return Exchange(t, d, prefill, partial(self._decode_ended, t, decision), server, token)

    async def _answer(
        self,
        x: Exchange,
        body: dict[str, Any],
        path: str,
        headers: dict[str, str],
        disconnected: asyncio.Task[None],
        chat: ChatPrompt | Fallback | None,
        stitch: Stitch | None,
    ) -> Response | None:
        """Decode's answer, relayed; None: decode failed before the client got a byte, and
        the request goes again as ``x.tracker.retried_as`` (``x.retry`` says why)."""
        t = x.tracker
        ids = chat.ids if isinstance(chat, ChatPrompt) else None
        resumable = stitch is not None and stitch.refused is None
        req = self._decode_request(
            x, with_token_ids(body) if resumable else body, path, headers, ids
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
        if upstream.status_code >= 500:
            msg = f"decode instance {x.decode.url} answered {upstream.status_code}"
            if self._decode_retry(x, "status_5xx", msg):
                await x.end("failed", msg)
                return None
        out_headers = {TRANSFER_ID_HEADER: t.transfer_id, TRACE_ID_HEADER: x.server.trace_id}
        if "content-type" in upstream.headers:
            out_headers["content-type"] = upstream.headers["content-type"]
        if is_streamed(body):
            # Whether decode loaded the KV is in its last event, not read here: kv_load
            # stays None and a recompute shows as ok.
            chunks = upstream.aiter_bytes()
            # The first chunk before the client's headers: until then a failure is retried.
            try:
                first = await first_or_none(anext(chunks, b""), disconnected)
            except httpx.HTTPError as e:
                return await self._decode_failed(x, e)
            if first is None:
                await x.end("client_gone")
                return Response(status_code=CLIENT_GONE)
            return StreamingResponse(
                relay(self, x, first, chunks, stitch, headers),
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
            t.kv_load_error = kv_load_error_of(content)
        await x.end(*self._verdict(x))
        return Response(content, status_code=upstream.status_code, headers=out_headers)

    def _verdict(self, x: Exchange) -> tuple[DecodeOutcome, str | None]:
        code = x.tracker.decode_status
        if code == 200:
            return "ok", None
        return "failed", f"decode instance {x.decode.url} answered {code}"

    def _stitch(
        self, body: dict[str, Any], path: str, chat: ChatPrompt | Fallback | None
    ) -> Stitch | None:
        """A streamed request's migration state (None: not streamed, or migration is off)."""
        if self.cfg.migration_limit <= 0 or not is_streamed(body):
            return None
        hint = list(chat.ids) if isinstance(chat, ChatPrompt) else None
        return Stitch(body, path, prompt_hint=hint, refused=refusal(body, path))

    def _decode_request(
        self,
        x: Exchange,
        body: dict[str, Any],
        path: str,
        headers: dict[str, str],
        ids: tuple[int, ...] | None,
    ) -> httpx.Request:
        t = x.tracker
        call = x.call = call_span(self.tracing, t, "decode", x.decode.url, path)
        tp = call.traceparent.header
        base, rank = dp_upstream(x.decode.url)
        return self.client.build_request(
            "POST",
            f"{base}{path}",
            json=(
                local_body(body, ids)
                if x.token is None
                else decode_body(body, t.transfer_id, self.cfg.router_url, x.token, tp, ids)
            ),
            headers={**headers, **rank, TRACEPARENT: tp},
        )

    async def _decode_failed(self, x: Exchange, e: httpx.HTTPError) -> JSONResponse | None:
        """Decode failed before the client got a byte: the error to answer, or None when the
        request is retried (``_decode_retry``)."""
        url = x.decode.url
        outcome: DecodeOutcome
        reason: Reason | None = None
        if is_connection_failure(e):
            x.decode.instance.mark(False, f"connection failed: {describe(e)}")
            status, kind, outcome, reason = 502, "bad_gateway", "unreachable", "connect"
            msg = f"decode instance {url} could not be reached: {describe(e)}"
        elif isinstance(e, httpx.TimeoutException):
            # Not retried: another request_timeout_s would double the client's wait.
            status, kind, outcome = 504, "gateway_timeout", "timeout"
            msg = (
                f"decode instance {url} did not answer within "
                f"{self.cfg.request_timeout_s:g} s: {describe(e)}"
            )
        else:
            status, kind, outcome, reason = 502, "bad_gateway", "broken", "reset"
            msg = f"decode instance {url} failed: {describe(e)}"
        log.error("transfer %s: %s", x.tracker.transfer_id, msg)
        if reason is not None and self._decode_retry(x, reason, msg):
            await x.end(outcome, msg)
            return None
        await x.end(outcome, msg)
        answer = error_response(status, msg, kind)
        # The id the proxy's and both sidecars' records know, for the operator's curl.
        answer.headers[TRANSFER_ID_HEADER] = x.tracker.transfer_id
        answer.headers[TRACE_ID_HEADER] = x.server.trace_id
        return answer

    def _decode_retry(self, x: Exchange, reason: Reason, error: str) -> bool:
        """Whether the request goes again on another decode (once, within the budget); if so
        ``x`` names the new transfer and why."""
        t, url = x.tracker, x.decode.url
        if any(r.stage == "decode" for r in t.retries):
            return False  # once per request
        failed = {r.instance for r in t.retries if r.stage == "decode"} | {url}
        if not any(i.available and i.url not in failed for i in self.decode.instances):
            self.metrics.not_retried("decode", "no_instance")
            return False
        if not self.budget.take():
            self.metrics.not_retried("decode", "budget")
            log.warning("transfer %s: decode failed; retry budget spent", t.transfer_id)
            return False
        self.metrics.retry("decode", reason)
        x.retry = Retry("decode", reason, url, error, t.transfer_id)
        t.retried_as = uuid.uuid4().hex
        log.warning("transfer %s: retrying the request as %s", t.transfer_id, t.retried_as)
        return True

    def _decode_ended(self, t: TransferTracker, decision: Decision, outcome: DecodeOutcome) -> None:
        self._live.pop(t.transfer_id, None)
        if self.cfg.flow is Flow.CONCURRENT:
            # Prefill's connector may still wait for the target: it hears why it will not come.
            self.targets.close(t.transfer_id, f"decode's request ended ({outcome})")
            if t.target_s is None and t.prefill_outcome == "ok":
                t.prefill_outcome = "no_target"  # it computed, but nothing was sent
        if t.retried_as is None:  # a retried request is counted once, when its retry ends
            self.metrics.request(t.path, decision, outcome)
        self._count_settled(t)

    def _count_settled(self, t: TransferTracker) -> None:
        """Count the record's final status once both sides ended (either may end last)."""
        if not t.counted and t.status != "pending":
            t.counted = True
            self.metrics.transfer(t.status, t.decode, t.disaggregated, t.recompute_reason)

    async def close(self) -> None:
        """Cut off every prefill still running (shutdown)."""
        await self.prefills.close()
