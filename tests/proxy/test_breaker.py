"""Circuit breakers: a failing instance is taken out, probed after an interval, taken back."""

from __future__ import annotations

import socket
from collections.abc import Callable

from app.proxy import Policy
from app.proxy.balancer import Pool, Routing
from app.proxy.breaker import Breaker, BreakerSettings, BreakerState, decode_ok
from tests.conftest import Clock
from tests.proxy.conftest import NO_RETRIES, Cluster, ServerThread, wait_for


def test_breaker_opens_after_n_failures_and_closes_through_half_open() -> None:
    clock = Clock(100.0)
    b = Breaker("d0", BreakerSettings(failures=3, probe_interval_s=2.0), clock)
    b.failure("500")
    b.success()  # consecutive: a success in between starts the count again
    b.failure("500")
    b.failure("500")
    assert (b.state, b.allows) == (BreakerState.CLOSED, True)
    b.failure("500")
    assert (b.state, b.allows, b.consecutive_failures) == (BreakerState.OPEN, False, 3)
    clock.now += 1.9
    assert not b.probe_due()
    clock.now += 0.1
    assert b.probe_due()
    b.probed(False, "503")  # reopened: the interval starts again
    assert not b.probe_due() and b.state is BreakerState.OPEN
    clock.now += 2.0
    b.probed(True)
    assert (b.state, b.allows) == (BreakerState.HALF_OPEN, True)
    assert b.take()  # the one trial request
    assert not b.allows
    b.failure("500")  # the trial failed: open again at once
    assert (b.state, b.opened_at) == (BreakerState.OPEN, clock.now)
    clock.now += 2.0
    b.probed(True)
    b.take()
    b.abandon_trial()  # the client left: another request may try
    assert b.allows
    b.take()
    b.success()
    assert (b.state, b.consecutive_failures, b.allows) == (BreakerState.CLOSED, 0, True)


def test_pool_skips_an_open_instance_and_a_taken_trial() -> None:
    pool = Pool("decode", ["http://d0", "http://d1"], Routing(Policy.ROUND_ROBIN))
    for inst in pool.instances:
        inst.mark(True)
    d0 = pool.instances[0]
    for _ in range(3):
        lease = pool.acquire()
        assert lease.url == "http://d0"
        lease.settle(False, "500")
        lease.settle(True)  # a request's first verdict is its only one
        lease.release()
        pool.acquire().release()  # d1's turn
    assert d0.breaker.state is BreakerState.OPEN
    assert {pool.acquire().url for _ in range(4)} == {"http://d1"}
    d0.breaker.probed(True)
    trial = pool.acquire()
    assert trial.url == "http://d0"
    assert pool.acquire().url == "http://d1"  # the trial is out: d0 waits for its verdict
    assert pool.acquire().url == "http://d1"
    trial.settle(True)
    trial.release()
    assert d0.breaker.state is BreakerState.CLOSED
    assert pool.acquire().url == "http://d0"


def test_decode_verdicts() -> None:
    assert decode_ok("ok", 200) is True
    assert decode_ok("failed", 400) is True  # the client's fault, not the instance's
    assert decode_ok("failed", 503) is False
    assert decode_ok("unreachable", None) is False
    assert decode_ok("broken", 200) is False
    assert decode_ok("client_gone", 200) is None


def test_a_decode_answering_500_is_skipped_then_taken_back(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster(n_prefill=1, n_decode=2).start_proxy(
        breaker_failures=3, breaker_probe_interval_s=1.0, **NO_RETRIES
    )
    d0, d1 = c.decode
    d0.behaviour.status = 500  # its /health still answers 200: only requests tell
    codes = [c.post(prompt="x").status_code for _ in range(6)]
    assert codes == [500, 200] * 3  # equal loads alternate
    h = c.get("/health").json()
    assert (h["decode"][0]["breaker"], h["decode"][0]["consecutive_failures"]) == ("open", 3)
    assert h["decode"][1]["breaker"] == "closed"
    assert h["status"] == "ok"
    # Well within the probe interval: every request goes to d1 and succeeds.
    assert [c.post(prompt="x").status_code for _ in range(5)] == [200] * 5
    assert (len(d0.requests), len(d1.requests)) == (3, 8)
    # Recovered: the probe passes, the one trial request succeeds, d0 is picked again.
    d0.behaviour.status = 200
    wait_for(
        "d0's breaker to go half-open",
        lambda: c.get("/health").json()["decode"][0]["breaker"] == "half_open",
    )
    assert [c.post(prompt="x").status_code for _ in range(4)] == [200] * 4
    assert len(d0.requests) == 5  # the trial, then every other one
    h = c.get("/health").json()
    assert (h["decode"][0]["breaker"], h["decode"][0]["consecutive_failures"]) == ("closed", 0)


def test_a_still_failing_decode_costs_one_request_per_probe(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster(n_prefill=1, n_decode=2).start_proxy(
        breaker_failures=1, breaker_probe_interval_s=1.0, **NO_RETRIES
    )
    d0 = c.decode[0]
    d0.behaviour.status = 503
    assert c.post(prompt="x").status_code == 503
    wait_for(
        "d0's breaker to go half-open",
        lambda: c.get("/health").json()["decode"][0]["breaker"] == "half_open",
    )
    # d1's turn in the rotation, then d0's trial.
    assert [c.post(prompt="x").status_code for _ in range(2)] == [200, 503]
    assert [c.post(prompt="x").status_code for _ in range(3)] == [200] * 3  # open again
    assert len(d0.requests) == 2
    h = c.get("/health").json()["decode"][0]
    assert (h["breaker"], h["consecutive_failures"]) == ("open", 2)


def test_a_stopped_decode_stays_out_until_it_answers_again(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster(n_prefill=1, n_decode=2).start_proxy(
        breaker_failures=1, breaker_probe_interval_s=0.2, **NO_RETRIES
    )
    d0, d1 = c.decode
    port = int(d0.url.rsplit(":", 1)[1])
    d0.stop()
    first = c.post(prompt="x")
    assert first.status_code == 502  # the request that found it gone
    h = c.get("/health").json()["decode"][0]
    assert (h["breaker"], h["healthy"]) == ("open", False)
    # Its /health probes fail too: no client request is spent on it.
    assert [c.post(prompt="x").status_code for _ in range(5)] == [200] * 5
    assert len(d1.requests) == 5
    # Back on the same port: the breaker's /health probe takes it back (the health checker's
    # interval, 30 s here, is not what brings it back).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    d0._client = None  # made on the stopped server's loop
    d0.server = ServerThread(d0.app, sock).start()
    wait_for(
        "d0's breaker to go half-open",
        lambda: c.get("/health").json()["decode"][0]["breaker"] == "half_open",
    )
    assert c.get("/health").json()["decode"][0]["healthy"] is True
    assert [c.post(prompt="x").status_code for _ in range(4)] == [200] * 4
    assert len(d0.requests) == 2
    assert c.get("/health").json()["decode"][0]["breaker"] == "closed"


def test_a_prefill_answering_500_is_taken_out(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster(n_prefill=2, n_decode=1).start_proxy(
        breaker_failures=2, breaker_probe_interval_s=30.0
    )
    p0, p1 = c.prefill
    p0.behaviour.status = 500
    tids = [c.post(prompt="x").headers["x-kv-transfer-id"] for _ in range(8)]
    # Clients never see prefill's failures (decode recomputes); p0 got its two, then none.
    assert [c.record(t)["status"] for t in tids].count("prefill_failed") == 2
    assert (len(p0.requests), len(p1.requests)) == (2, 6)
    h = c.get("/health").json()["prefill"][0]
    assert (h["breaker"], h["consecutive_failures"]) == ("open", 2)


def test_a_trial_that_ends_without_a_verdict_frees_the_trial() -> None:
    pool = Pool("decode", ["http://d0"], Routing(Policy.ROUND_ROBIN))
    d0 = pool.instances[0]
    d0.mark(True)
    d0.breaker.failure("x")
    d0.breaker.failure("x")
    d0.breaker.failure("x")
    d0.breaker.probed(True)
    trial = pool.acquire()
    assert not d0.available
    trial.settle(None)  # the client left: says nothing of the instance
    trial.release()
    assert d0.available and d0.breaker.state is BreakerState.HALF_OPEN
