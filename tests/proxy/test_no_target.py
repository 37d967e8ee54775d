"""No target from decode (late, never, or refused): prefill is not called; decode answers."""

from __future__ import annotations

import time
from collections.abc import Callable

from tests.proxy.conftest import Cluster


def test_target_timeout_relays_decode_without_prefill(
    make_cluster: Callable[..., Cluster],
) -> None:
    # The proxy gives up after 0.3 s; decode's target comes at 0.6 s, too late.
    cluster = make_cluster().start_proxy(target_timeout_s=0.3)
    d, p = cluster.decode[0], cluster.prefill[0]
    d.behaviour.post_delay_s = 0.6
    r = cluster.post(prompt="x")
    assert r.status_code == 200
    assert r.content == d.answers[-1]
    assert not p.requests
    ((payload, status, answer),) = d.posts
    assert status == 409  # the late post is told why, not just "unknown"
    assert answer["error"]["message"] == (
        f"transfer {payload['transfer_id']!r} is no longer waiting: no target came within 0.3 s"
    )
    rec = cluster.record(r.headers["x-kv-transfer-id"])
    assert rec["status"] == "target_timeout"
    assert rec["target_ms"] is None and rec["prefill_ms"] is None
    assert rec["total_ms"] >= 600


def test_decode_ending_before_any_target_skips_prefill_at_once(cluster: Cluster) -> None:
    # E.g. decode had the whole prompt cached: its connector posts nothing.
    d, p = cluster.decode[0], cluster.prefill[0]
    d.behaviour.post_target = False
    t0 = time.monotonic()
    r = cluster.post(prompt="x", stream=True)
    assert time.monotonic() - t0 < 2  # not held for the 5 s target timeout
    assert r.status_code == 200
    assert r.content == d.answers[-1]
    rec = cluster.record(r.headers["x-kv-transfer-id"])
    assert rec["status"] == "no_target"
    time.sleep(0.1)
    assert not p.requests
    assert cluster.get("/health").json()["prefill"][0]["outstanding"] == 0


def test_decode_posting_an_error_skips_prefill(cluster: Cluster) -> None:
    d, p = cluster.decode[0], cluster.prefill[0]
    d.behaviour.target_error = "sidecar refused: layout mismatch"
    r = cluster.post(prompt="x")
    assert r.status_code == 200
    assert [(status, answer) for _, status, answer in d.posts] == [(200, {"ok": True})]
    rec = cluster.record(r.headers["x-kv-transfer-id"])
    assert rec["status"] == "target_error"
    assert "sidecar refused: layout mismatch" in rec["error"]
    assert not p.requests
