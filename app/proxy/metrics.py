"""The proxy's Prometheus metrics (``GET /metrics``), in a registry of their own per app, so
that several proxies in one process never share or clash.

Counters are counted as requests end (picks as they are made); breaker states, instance
health and the KV-event indexes are read when scraped; requests in flight are counted by an
ASGI wrapper around the app.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Receive, Scope, Send

from app.proxy.balancer import Pool
from app.proxy.breaker import BreakerState
from app.proxy.disagg import Decision
from app.proxy.kv_events import KvEventFeed
from app.proxy.routing import Pick

# kvproxy_breaker_state's values.
BREAKER_VALUES = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}
# kvproxy_requests_total's outcome for an answer the proxy gave without calling decode.
REFUSED = "refused"
CONTENT_TYPE = CONTENT_TYPE_LATEST


class _PoolCollector(Collector):
    """Breaker state and health of every instance, and the state of every KV-event index the
    proxy follows, read when scraped."""

    def __init__(self, pools: Mapping[str, Pool], feed: KvEventFeed | None) -> None:
        self.pools = pools
        self.feed = feed

    def collect(self) -> Iterator[Metric]:
        breaker = GaugeMetricFamily(
            "kvproxy_breaker_state",
            "Circuit breaker of each instance: 0 closed, 1 half-open, 2 open (never picked).",
            labels=["role", "instance"],
        )
        healthy = GaugeMetricFamily(
            "kvproxy_instance_healthy",
            "1 when the instance's last health probe (or request) found it healthy.",
            labels=["role", "instance"],
        )
        for role, pool in self.pools.items():
            for inst in pool.instances:
                breaker.add_metric([role, inst.url], BREAKER_VALUES[inst.breaker.state])
                healthy.add_metric([role, inst.url], int(inst.healthy))
        yield breaker
        yield healthy
        if self.feed is None:
            return
        consistent = GaugeMetricFamily(
            "kvproxy_kv_events_consistent",
            "1 when the instance's KV-event index answers picks; 0 while the prefix index "
            "stands in for it (/health's kv_events says why).",
            labels=["instance"],
        )
        blocks = GaugeMetricFamily(
            "kvproxy_kv_events_blocks",
            "Blocks the instance's KV-event index holds (--kv-events-max-blocks bounds it).",
            labels=["instance"],
        )
        for status in self.feed.status():
            consistent.add_metric([status.name], int(status.index.consistent))
            blocks.add_metric([status.name], status.index.blocks)
        yield consistent
        yield blocks


class ProxyMetrics:
    """One proxy app's metrics and its registry."""

    def __init__(self, pools: Mapping[str, Pool], feed: KvEventFeed | None = None) -> None:
        self.registry = CollectorRegistry()
        self._requests = Counter(
            "kvproxy_requests",
            "Completions requests by route, decision (disaggregated, local, or none when "
            "refused first), reason of a local one (short, cached, no_prefill) and decode's "
            "outcome (ok, failed, unreachable, timeout, broken, client_gone, or refused).",
            ["route", "decision", "reason", "outcome"],
            registry=self.registry,
        )
        self._transfers = Counter(
            "kvproxy_transfers",
            "Requests by the final status of their transfer record (GET /v1/transfers).",
            ["outcome"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "kvproxy_requests_in_flight",
            "Requests being served (those --max-inflight counts; /health, /metrics and the "
            "engines' /v1/kv_targets are not).",
            registry=self.registry,
        )
        self._picks = Counter(
            "kvproxy_picks",
            "Instances picked, by role and where the pick's hit came from (kv_events, "
            "in_flight, approximate, or none for policies that read no hit).",
            ["role", "source"],
            registry=self.registry,
        )
        self._no_prefill = Counter(
            "kvproxy_prefill_unavailable",
            "Requests that needed a prefill when no prefill instance was available (all "
            "unhealthy or their breakers open), by what the proxy did: decode_alone (decode "
            "computed the prompt) or refused (503, --without-prefill refuse).",
            ["action"],
            registry=self.registry,
        )
        self._retries = Counter(
            "kvproxy_retries",
            "Retries made, by the stage retried (prefill: same transfer, another prefill; "
            "decode: the whole request on another decode) and why (connect, reset, status_5xx).",
            ["stage", "reason"],
            registry=self.registry,
        )
        self._not_retried = Counter(
            "kvproxy_retries_refused",
            "Failures that could have been retried and were not, by stage and why: budget "
            "(the retry budget was spent) or no_instance (no other instance available).",
            ["stage", "why"],
            registry=self.registry,
        )
        self._migrations = Counter(
            "kvproxy_migrations",
            "Streams whose decode broke off after the first byte, by what the proxy did: "
            "resumed (on another decode), completed (only the end was missing), not_resumable, "
            "limit (--migration-limit), budget (retry budget spent), no_instance.",
            ["outcome"],
            registry=self.registry,
        )
        # Named after vLLM's vllm:nixl_num_failed_transfers: same meaning, seen from the proxy.
        self._failed = Counter(
            "kvproxy_num_failed_transfers",
            "Disaggregated requests whose KV did not reach decode, by decode instance and the "
            "record's status (prefill_failed, send_failed, target_timeout, target_error, "
            "no_target, recomputed).",
            ["instance", "status"],
            registry=self.registry,
        )
        self._prompts = Counter(
            "kvproxy_decode_prompts",
            "Prompts decode answered, by decode instance and who computed them: transfer "
            "(prefill, its KV loaded), local (decode alone by choice) or recomputed (a failed "
            "or missing transfer). Share computed by decode: source!=transfer over all.",
            ["instance", "source"],
            registry=self.registry,
        )
        self._recomputes = Counter(
            "kvproxy_recomputes",
            "Disaggregated requests decode recomputed after its KV load failed, by decode "
            "instance and why, as decode's connector said: kv_digest_mismatch (the KV landed "
            "but differed from what prefill sent), transfer_failed, or unreported.",
            ["instance", "reason"],
            registry=self.registry,
        )
        self._stops = Counter(
            "kvproxy_decode_stops",
            "Transfers whose prefill failed for good and whose decode sidecar the proxy told to "
            "stop waiting (--decode-sidecar), by outcome: ok (aborted, or ended already) or "
            "failed (the sidecar did not take it: decode waits for its deadline).",
            ["outcome"],
            registry=self.registry,
        )
        self._chat_prompts = Counter(
            "kvproxy_chat_prompts",
            "Chat requests by how they were routed: engine (rendered to ids by an engine's "
            "/tokenize), cache (ids rendered before) or text (hashed as text, "
            "kvproxy_chat_tokens_fallbacks_total says why).",
            ["source"],
            registry=self.registry,
        )
        self._chat_fallbacks = Counter(
            "kvproxy_chat_tokens_fallbacks",
            "Chat requests routed as text, by why they were not rendered to ids: field, "
            "non_text, batch, invalid, too_large, no_instance, timeout, unreachable, "
            "engine_refused, bad_answer (chat_tokens.py).",
            ["reason"],
            registry=self.registry,
        )
        self._tokenize_s = Histogram(
            "kvproxy_chat_tokenize_seconds",
            "Time of each /tokenize call the proxy made for a chat request (cache hits make none).",
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
            registry=self.registry,
        )
        self.registry.register(_PoolCollector(pools, feed))

    def chat_prompt(self, source: str, fallback: str | None, call_s: float | None) -> None:
        """A chat request was rendered to ids (``source``: engine or cache) or routed as text
        (``fallback``: why); ``call_s``: its /tokenize call's time, if one was made."""
        self._chat_prompts.labels("text" if fallback is not None else source).inc()
        if fallback is not None:
            self._chat_fallbacks.labels(fallback).inc()
        if call_s is not None:
            self._tokenize_s.observe(call_s)

    def pick(self, role: str, pick: Pick | None) -> None:
        """An instance of ``role`` was picked for a request."""
        source = "none" if pick is None or pick.hit_source is None else pick.hit_source
        self._picks.labels(role, source).inc()

    def request(self, route: str, decision: Decision | None, outcome: str) -> None:
        """A completions request ended; ``decision`` None: refused before there was one."""
        if decision is None:
            kind, reason = "none", ""
        elif decision.disaggregated:
            kind, reason = "disaggregated", ""
        else:
            kind, reason = "local", decision.kind
        self._requests.labels(route, kind, reason, outcome).inc()

    def prefill_unavailable(self, action: str) -> None:
        """A request needed a prefill and found none: ``decode_alone`` or ``refused``."""
        self._no_prefill.labels(action).inc()

    def transfer(
        self, status: str, decode: str, disaggregated: bool, recompute_reason: str | None = None
    ) -> None:
        """A transfer record settled with ``status`` (decode's instance ``decode``);
        ``recompute_reason``: why, when ``status`` is recomputed."""
        self._transfers.labels(status).inc()
        if status in ("decode_failed", "client_gone"):
            return  # no prompt answered, so nothing to say who computed it
        if status in ("ok", "local"):
            self._prompts.labels(decode, "transfer" if status == "ok" else "local").inc()
            return
        self._prompts.labels(decode, "recomputed").inc()
        if disaggregated:
            self._failed.labels(decode, status).inc()
        if recompute_reason is not None:
            self._recomputes.labels(decode, recompute_reason).inc()

    def retry(self, stage: str, reason: str) -> None:
        self._retries.labels(stage, reason).inc()

    def migration(self, outcome: str) -> None:
        self._migrations.labels(outcome).inc()

    def decode_stop(self, outcome: str) -> None:
        self._stops.labels(outcome).inc()

    def not_retried(self, stage: str, why: str) -> None:
        self._not_retried.labels(stage, why).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class CountInflight:
    """ASGI wrapper counting requests in ``gauge`` while the app serves them (a streamed
    answer until its last chunk), except for paths that start with one of ``exempt``."""

    def __init__(self, app: ASGIApp, gauge: Gauge, exempt: tuple[str, ...]) -> None:
        self._app = app
        self._gauge = gauge
        self._exempt = exempt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith(self._exempt):
            await self._app(scope, receive, send)
            return
        self._gauge.inc()
        try:
            await self._app(scope, receive, send)
        finally:
            self._gauge.dec()
