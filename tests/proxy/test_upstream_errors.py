"""Upstream failures: decode unreachable is a 502 naming it; a failed prefill, with no other
prefill and no ``--decode-sidecar`` to tell, is only logged (test_decode_told.py)."""

from __future__ import annotations

from collections.abc import Callable

from tests.proxy.conftest import Cluster


def test_decode_refusing_connections_is_502_and_marks_it_down(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster(n_prefill=1, n_decode=1).start_proxy()
    d = c.decode[0]
    d.stop()  # healthy at the startup probe, gone now; the next probe is 30 s away
    r = c.post(prompt="x")
    assert r.status_code == 502
    err = r.json()["error"]
    assert err["type"] == "bad_gateway"
    assert err["message"].startswith(f"decode instance {d.url} could not be reached: Connect")
    tid = r.headers["x-kv-transfer-id"]  # also on an error: the records' id
    assert tid == c.get("/v1/transfers").json()["transfers"][-1]["transfer_id"]
    rec = c.record(tid)
    assert rec["status"] == "decode_failed"
    assert rec["prefill_ms"] is None  # prefill never got the prompt
    assert not c.prefill[0].requests
    # Marked unhealthy at once, not at the next probe.
    h = c.get("/health")
    assert h.status_code == 503
    assert h.json()["decode"][0]["last_error"].startswith("connection failed: Connect")
    assert h.json()["prefill"][0]["outstanding"] == 0


def test_decode_error_status_passes_through_without_prefill(cluster: Cluster) -> None:
    d = cluster.decode[0]
    d.behaviour.status = 400
    d.behaviour.post_target = False  # vLLM refuses the request before it allocates anything
    r = cluster.post(prompt="x")
    assert r.status_code == 400
    assert r.content == d.answers[-1]
    rec = cluster.record(r.headers["x-kv-transfer-id"])
    assert (rec["status"], rec["decode_status"]) == ("decode_failed", 400)
    assert not cluster.prefill[0].requests


def test_prefill_error_is_logged_and_decode_answer_still_relayed(cluster: Cluster) -> None:
    cluster.prefill[0].behaviour.status = 500
    r = cluster.post(prompt="x")
    assert r.status_code == 200
    assert r.content == cluster.decode[0].answers[-1]
    rec = cluster.record(r.headers["x-kv-transfer-id"])
    assert rec["status"] == "prefill_failed"
    assert rec["prefill_status"] == 500
    assert rec["error"].startswith(f"prefill instance {cluster.prefill[0].url} answered 500")


def test_prefill_refusing_connections_is_logged_and_marks_it_down(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster(n_prefill=1, n_decode=1).start_proxy()
    c.prefill[0].stop()
    c.decode[0].behaviour.prefill_wait_s = 0.3  # decode's sidecar would give up and recompute
    r = c.post(prompt="x")
    assert r.status_code == 200
    assert r.content == c.decode[0].answers[-1]
    rec = c.record(r.headers["x-kv-transfer-id"])
    assert rec["status"] == "prefill_failed"
    assert rec["error"].startswith(f"prefill instance {c.prefill[0].url} failed: Connect")
    assert c.get("/health").json()["prefill"][0]["healthy"] is False
