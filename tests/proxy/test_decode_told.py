"""A prefill that failed for good, or answered that its sidecar sent nothing, is told to
decode's sidecar at once (an abort of the transfer there), so decode recomputes now instead of
waiting out its deadline."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from tests.proxy.conftest import Cluster, sample

DEADLINE_S = 5.0  # how long the fake decode would wait for the KV


@pytest.mark.parametrize("flow", ["decode_first", "concurrent"])
@pytest.mark.parametrize("failure", ["refused", "500", "sent_nothing"])
def test_a_failed_prefill_with_no_other_is_told_to_decode_at_once(
    make_cluster: Callable[..., Cluster], flow: str, failure: str
) -> None:
    c = make_cluster(n_prefill=1, n_decode=1)
    sidecars = c.with_decode_sidecars(token="s3cret")
    c.start_proxy(flow=flow, decode_sidecars=sidecars, decode_sidecar_token="s3cret")
    p, d, sidecar = c.prefill[0], c.decode[0], c.sidecars[0]
    d.behaviour.prefill_wait_s = DEADLINE_S
    if failure == "refused":
        p.stop()
    elif failure == "500":  # the prompt reached it, it failed mid-prefill: no KV comes
        p.behaviour.status, p.behaviour.delivers = 500, False
    else:  # it answered, but its connector says its sidecar was gone
        p.behaviour.kv_send, p.behaviour.delivers = "failed", False
    t0 = time.monotonic()
    r = c.post(prompt="x")
    took = time.monotonic() - t0
    assert r.status_code == 200 and r.content == d.answers[-1]
    assert took < 1.0, f"decode answered {took:.2f} s after the request: it waited for the KV"
    tid = r.headers["x-kv-transfer-id"]
    (abort,) = sidecar.aborts
    assert abort.path == f"/v1/requests/{tid}/abort"
    assert abort.headers["authorization"] == "Bearer s3cret"
    assert abort.body["reason"].startswith(f"prefill failed: prefill instance {p.url}")
    rec = c.record(tid)
    status = "send_failed" if failure == "sent_nothing" else "prefill_failed"
    assert (rec["status"], rec["kv_load"]) == (status, "failed"), rec
    if failure == "sent_nothing":
        assert rec["error"].endswith(f"sent no KV: {p.name}: gone"), rec
    assert rec["decode_stop"] == f"{sidecar.url} answered 200"
    assert sample(c.metrics(), "kvproxy_decode_stops_total", outcome="ok") == 1


def test_without_the_sidecar_decode_waits_for_its_deadline(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster(n_prefill=1, n_decode=1).start_proxy()  # no --decode-sidecar
    p = c.prefill[0]
    p.behaviour.status, p.behaviour.delivers = 500, False
    c.decode[0].behaviour.prefill_wait_s = 0.5
    t0 = time.monotonic()
    rec = c.record(c.post(prompt="x").headers["x-kv-transfer-id"])
    assert time.monotonic() - t0 >= 0.5
    assert (rec["status"], rec["decode_stop"]) == ("prefill_failed", None)


def test_a_sidecar_that_refuses_the_abort_is_in_the_record(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster(n_prefill=1, n_decode=1)
    sidecars = c.with_decode_sidecars(token="s3cret")
    c.start_proxy(decode_sidecars=sidecars, decode_sidecar_token="wrong")
    p = c.prefill[0]
    p.behaviour.status, p.behaviour.delivers = 500, False
    c.decode[0].behaviour.prefill_wait_s = 0.3
    rec = c.record(c.post(prompt="x").headers["x-kv-transfer-id"])
    assert rec["decode_stop"].startswith(f"{c.sidecars[0].url} answered 401")
    assert sample(c.metrics(), "kvproxy_decode_stops_total", outcome="failed") == 1
