"""The prefill side of a disaggregated request: the call to prefill, and its one retry.

A prefill the prompt never reached (the connection could not be made) wrote nothing, so it
is retried for the same transfer (same id, same token) on another available prefill, within
the retry budget: concurrent, the new prefill's connector fetches the same target from the
rendezvous (any number may); decode first, it is sent the same targets. A prefill that failed
after the prompt reached it (reset, 5xx, timeout) may have claimed decode's blocks, and
decode's sidecar takes one prefill per transfer, so it is not retried.

A prefill that failed for good (not retried, or its retry failed too), or that answered but
says its sidecar sent nothing (``kv_send: "failed"``, its sidecar was gone), is told to decode's
sidecar at once where the proxy knows it (decode_stop.py): decode recomputes now instead of
waiting out its deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import httpx

from app.proxy.balancer import Lease, Pool, is_connection_failure
from app.proxy.bodies import kv_send_failure, prefill_body
from app.proxy.config import Flow, ProxyConfig
from app.proxy.decode_stop import DecodeStopper
from app.proxy.dp import upstream as dp_upstream
from app.proxy.errors import NoHealthyInstance, TargetError
from app.proxy.exchange import PrefillJob, describe
from app.proxy.metrics import ProxyMetrics
from app.proxy.records import TransferTracker
from app.proxy.retries import Retry, RetryBudget
from app.proxy.routing import shape_of
from app.proxy.spans import call_span
from app.proxy.targets import TargetRendezvous
from app.tracing.otel import Span, Tracing
from app.tracing.traceparent import HEADER as TRACEPARENT

log = logging.getLogger(__name__)

Build = Callable[[Span], dict[str, Any]]  # prefill's body, given the call's span


class PrefillSide:
    """Runs each request's prefill as a task of its own; ``settled`` is told when one ends."""

    def __init__(
        self,
        cfg: ProxyConfig,
        pool: Pool,
        targets: TargetRendezvous,
        client: httpx.AsyncClient,
        metrics: ProxyMetrics,
        budget: RetryBudget,
        settled: Callable[[TransferTracker], None],
        stopper: DecodeStopper,
    ) -> None:
        self.cfg = cfg
        self.pool = pool
        self.targets = targets
        self.client = client
        self.metrics = metrics
        self.budget = budget
        self._settled = settled
        self.stopper = stopper
        self.tracing: Tracing | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, job: PrefillJob) -> asyncio.Task[None]:
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
            self._settled(t)
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
        await self._with_retry(
            job,
            lambda call: prefill_body(
                job.body,
                tid,
                token=job.token,
                targets=stages,
                traceparent=call.traceparent.header,
                prompt_ids=job.prompt_ids,
            ),
        )

    async def _prefill_now(self, job: PrefillJob) -> None:
        """Concurrent: the prompt goes to prefill at once; its connector fetches the target."""
        t = job.tracker
        await self._with_retry(
            job,
            lambda call: prefill_body(
                job.body,
                t.transfer_id,
                token=job.token,
                router_url=self.cfg.router_url,
                target_timeout_s=self.cfg.target_timeout_s,
                traceparent=call.traceparent.header,
                prompt_ids=job.prompt_ids,
            ),
        )

    async def _with_retry(self, job: PrefillJob, build: Build) -> None:
        """The call to prefill; once more on another prefill if the first was never reached."""
        t = job.tracker
        error_before = t.error
        if await self._post(job, build) and (retry := self._retry(job)) is not None:
            job.lease.release()  # the failed one no longer counts as busy (released once)
            # The retry's record: the failure moves from ``error`` to ``retries``.
            t.error = error_before
            t.prefill_outcome = t.prefill_status = None
            try:
                await self._post(replace(job, lease=retry), build)
            finally:
                retry.release()
        if t.prefill_outcome in ("prefill_failed", "send_failed"):
            await self._stop_decode(t)

    async def _stop_decode(self, t: TransferTracker) -> None:
        """Prefill failed for good: decode's sidecar stops waiting for it (if known)."""
        tid = t.transfer_id
        if not self.stopper.knows(t.decode):
            log.warning("transfer %s: decode recomputes after its sidecar gives up", tid)
            return
        if t.target_s is None:
            # Concurrent: decode knows the transfer once it posted its target.
            try:
                await self.targets.wait(tid, self.cfg.target_timeout_s)
            except (TimeoutError, TargetError, KeyError):
                return  # no target came, or the id closed: decode does not wait for one
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                return  # closed while we waited: decode's request ended
        answers = await self.stopper.stop(t.decode, tid, f"prefill failed: {t.error or ''}")
        ok = all(a.ok for a in answers)
        t.decode_stop = "; ".join(f"{a.admin_url} {a.detail}" for a in answers)
        self.metrics.decode_stop("ok" if ok else "failed")
        if ok:
            log.warning("transfer %s: decode told to recompute now (%s)", tid, t.decode_stop)
        else:
            log.error("transfer %s: decode could not be told: %s", tid, t.decode_stop)

    def _retry(self, job: PrefillJob) -> Lease | None:
        """Another prefill's lease for ``job``'s failed call, or None (none, or no budget)."""
        t, failed = job.tracker, job.lease.url
        others = frozenset({failed})
        # Looked at before the budget is spent; picked after, so a refusal picks nothing.
        if not any(i.available and i.url not in others for i in self.pool.instances):
            self.metrics.not_retried("prefill", "no_instance")
            return None
        if not self.budget.take():
            self.metrics.not_retried("prefill", "budget")
            log.warning("transfer %s: prefill %s failed; retry budget spent", t.transfer_id, failed)
            return None
        shape = shape_of(
            job.body,
            job.path,
            self.cfg.prefix_block_size,
            self.cfg.max_model_len,
            job.prompt_ids,
        )
        try:
            lease = self.pool.acquire(shape, exclude=others)
        except NoHealthyInstance:  # cannot happen in between (one event loop); said all the same
            self.metrics.not_retried("prefill", "no_instance")
            return None
        self.metrics.pick("prefill", lease.pick)
        self.metrics.retry("prefill", "connect")
        t.retries += (Retry("prefill", "connect", failed, t.error or "", t.transfer_id),)
        t.prefill, t.prefill_pick = lease.url, lease.pick
        log.warning(
            "transfer %s: prefill %s unreachable; retrying on %s", t.transfer_id, failed, lease.url
        )
        return lease

    async def _post(self, job: PrefillJob, build: Build) -> bool:
        """The call to prefill, timed by its own span; True: the prompt never reached it."""
        t = job.tracker
        call = call_span(self.tracing, t, "prefill", job.lease.url, job.path)
        try:
            headers = {**job.headers, TRACEPARENT: call.traceparent.header}
            return await self._send(job, build(call), headers)
        finally:
            call.set("http.response.status_code", t.prefill_status)
            call.set("kv.outcome", t.prefill_outcome or "cancelled")
            call.end(None if t.prefill_outcome == "ok" else (t.prefill_outcome or "cancelled"))

    async def _send(self, job: PrefillJob, out: dict[str, Any], headers: dict[str, str]) -> bool:
        t, p = job.tracker, job.lease
        tid = t.transfer_id
        t0 = time.monotonic()
        try:
            base, rank = dp_upstream(p.url)
            r = await self.client.post(f"{base}{job.path}", json=out, headers={**headers, **rank})
        except httpx.HTTPError as e:
            unreached = is_connection_failure(e)
            if unreached:
                p.instance.mark(False, f"connection failed: {describe(e)}")
            t.prefill_outcome = "prefill_failed"
            msg = f"prefill instance {p.url} failed: {describe(e)}"
            p.settle(False, msg)
            t.note_error(msg)
            log.error("transfer %s: %s", tid, msg)
            return unreached
        finally:
            t.prefill_s = time.monotonic() - t0
        t.prefill_status = r.status_code
        if r.status_code == 200 and (why := kv_send_failure(r.content)) is not None:
            # Answered, but its sidecar was gone: nothing reached decode, and every request
            # there costs decode a recompute, so it counts against the instance's breaker.
            t.prefill_outcome = "send_failed"
            msg = f"prefill instance {p.url} sent no KV: {why}"
            p.settle(False, msg)
            t.note_error(msg)
            log.error("transfer %s: %s", tid, msg)
            return False
        p.settle(r.status_code < 500, f"answered {r.status_code}")
        if r.status_code == 200:
            t.prefill_outcome = "ok"
            return False
        t.prefill_outcome = "prefill_failed"
        msg = f"prefill instance {p.url} answered {r.status_code}: {r.text[:300]}"
        t.note_error(msg)
        log.error("transfer %s: %s", tid, msg)
        return False

    async def close(self) -> None:
        """Cut off every prefill still running (shutdown)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
