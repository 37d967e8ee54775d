"""Instance picking: round-robin alternates; least-outstanding picks the idle instance."""

from __future__ import annotations

import threading
from collections.abc import Callable

from tests.proxy.conftest import Cluster, wait_for


def test_round_robin_alternates_over_two_decodes_and_two_prefills(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster(n_prefill=2, n_decode=2).start_proxy(policy="round_robin")
    for _ in range(4):
        assert c.post(prompt="x").status_code == 200
    d_order = [name for name in c.shared.order if name.startswith("d")]
    p_order = [name for name in c.shared.order if name.startswith("p")]
    assert d_order == ["d0", "d1", "d0", "d1"]
    assert p_order == ["p0", "p1", "p0", "p1"]


def test_least_outstanding_picks_the_idle_decode(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster(n_prefill=1, n_decode=2).start_proxy(policy="least_outstanding")
    d0, d1 = c.decode
    gate = threading.Event()
    d0.behaviour.hold = gate  # d0 takes the first request and sits on it
    first = threading.Thread(target=c.post, kwargs={"prompt": "long"})
    first.start()
    try:
        wait_for("d0 to take the first request", lambda: d0.requests)
        for _ in range(3):
            # Round-robin would send the second of these to the busy d0 (and time out).
            assert c.post(prompt="short", timeout=3).status_code == 200
        assert len(d0.requests) == 1
        assert len(d1.requests) == 3
        health = c.get("/health").json()
        assert [i["outstanding"] for i in health["decode"]] == [1, 0]
    finally:
        gate.set()
        first.join(10)
    health = c.get("/health").json()
    assert [i["outstanding"] for i in health["decode"]] == [0, 0]
    assert [i["served"] for i in health["decode"]] == [1, 3]


def test_unhealthy_instance_is_skipped(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster(n_prefill=1, n_decode=2)
    c.decode[0].behaviour.health_status = 503
    c.start_proxy(policy="round_robin")
    for _ in range(3):
        assert c.post(prompt="x").status_code == 200
    assert not c.decode[0].requests
    assert len(c.decode[1].requests) == 3
    assert c.get("/health").json()["decode"][0]["healthy"] is False
