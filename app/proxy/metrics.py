"""The proxy's Prometheus metrics (``GET /metrics``), in a registry of their own per app, so
that several proxies in one process never share or clash.

Counters are counted as requests end; breaker states and instance health are read from the
pools when scraped; requests in flight are counted by an ASGI wrapper around the app.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Receive, Scope, Send

from app.proxy.balancer import Pool
from app.proxy.breaker import BreakerState
from app.proxy.disagg import Decision

# kvproxy_breaker_state's values.
BREAKER_VALUES = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}
# kvproxy_requests_total's outcome for an answer the proxy gave without calling decode.
REFUSED = "refused"
CONTENT_TYPE = CONTENT_TYPE_LATEST


class _PoolCollector(Collector):
    """Breaker state and health of every instance, read when scraped."""

    def __init__(self, pools: Mapping[str, Pool]) -> None:
        self.pools = pools

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


class ProxyMetrics:
    """One proxy app's metrics and its registry."""

    def __init__(self, pools: Mapping[str, Pool]) -> None:
        self.registry = CollectorRegistry()
        self._requests = Counter(
            "kvproxy_requests",
            "Completions requests by route, decision (disaggregated, local, or none when "
            "refused first), reason of a local one (short, cached) and decode's outcome "
            "(ok, failed, unreachable, timeout, broken, client_gone, or refused).",
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
        self.registry.register(_PoolCollector(pools))

    def request(self, route: str, decision: Decision | None, outcome: str) -> None:
        """A completions request ended; ``decision`` None: refused before there was one."""
        if decision is None:
            kind, reason = "none", ""
        elif decision.disaggregated:
            kind, reason = "disaggregated", ""
        else:
            kind, reason = "local", decision.kind
        self._requests.labels(route, kind, reason, outcome).inc()

    def transfer(self, status: str) -> None:
        """A transfer record settled with ``status``."""
        self._transfers.labels(status).inc()

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
