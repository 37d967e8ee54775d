"""GET /metrics: requests by decision and outcome, transfers by final status, breaker states and
requests in flight, each proxy in its own registry."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tests.proxy.conftest import NO_RETRIES, Cluster, Samples, sample, wait_for


def requests(samples: Samples, decision: str, reason: str, outcome: str) -> float | None:
    labels = {"route": "/v1/completions", "decision": decision, "reason": reason}
    return sample(samples, "kvproxy_requests_total", **labels, outcome=outcome)


def test_requests_and_transfers_are_counted_by_decision_and_outcome(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster().start_proxy(min_prefill_tokens=100)
    d = c.decode[0]
    tids = [c.post(prompt=list(range(200))).headers["x-kv-transfer-id"] for _ in range(2)]
    tids.append(c.post(prompt=[1, 2]).headers["x-kv-transfer-id"])  # short: decode alone
    d.behaviour.status = 500
    tids.append(c.post(prompt=list(range(200))).headers["x-kv-transfer-id"])
    failed_alone = c.post(prompt=[1, 2])
    assert failed_alone.status_code == 500
    tids.append(failed_alone.headers["x-kv-transfer-id"])
    bad = c.client.post(f"{c.url}/v1/completions", content=b"[", timeout=5)
    assert bad.status_code == 400
    for tid in tids:
        c.record(tid)  # settled
    s = c.metrics()
    assert requests(s, "disaggregated", "", "ok") == 2
    assert requests(s, "disaggregated", "", "failed") == 1
    assert requests(s, "local", "short", "ok") == 1
    assert requests(s, "local", "short", "failed") == 1
    assert requests(s, "none", "", "refused") == 1
    assert sample(s, "kvproxy_transfers_total", outcome="ok") == 2
    assert sample(s, "kvproxy_transfers_total", outcome="local") == 1
    assert sample(s, "kvproxy_transfers_total", outcome="decode_failed") == 2


def test_breaker_states_are_read_when_scraped(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster(n_prefill=1, n_decode=2).start_proxy(
        breaker_failures=1, breaker_probe_interval_s=30.0, **NO_RETRIES
    )
    d0, d1 = c.decode
    d0.behaviour.status = 500
    assert c.post(prompt="x").status_code == 500  # d0 first: its breaker opens
    s = c.metrics()
    assert sample(s, "kvproxy_breaker_state", role="decode", instance=d0.url) == 2
    assert sample(s, "kvproxy_breaker_state", role="decode", instance=d1.url) == 0
    assert sample(s, "kvproxy_breaker_state", role="prefill", instance=c.prefill[0].url) == 0
    assert sample(s, "kvproxy_instance_healthy", role="decode", instance=d0.url) == 1


def test_requests_in_flight_rise_and_fall(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster()
    gate = threading.Event()
    c.decode[0].behaviour.hold = gate
    c.start_proxy()
    assert sample(c.metrics(), "kvproxy_requests_in_flight") == 0  # scrapes do not count
    with ThreadPoolExecutor(2) as pool:
        held = [pool.submit(c.post, prompt="x", stream=i == 1) for i in range(2)]
        try:
            wait_for("two requests in flight", lambda: len(c.decode[0].requests) == 2)
            during = sample(c.metrics(), "kvproxy_requests_in_flight")
        finally:
            gate.set()
        assert [f.result().status_code for f in held] == [200, 200]
    assert during == 2
    assert sample(c.metrics(), "kvproxy_requests_in_flight") == 0


def test_each_proxy_counts_only_its_own(make_cluster: Callable[..., Cluster]) -> None:
    a, b = make_cluster().start_proxy(), make_cluster().start_proxy()
    for _ in range(3):
        assert a.post(prompt="x").status_code == 200
    assert b.post(prompt="x").status_code == 200
    assert requests(a.metrics(), "disaggregated", "", "ok") == 3
    assert requests(b.metrics(), "disaggregated", "", "ok") == 1
