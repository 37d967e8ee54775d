"""A prefill the prompt never reached (connection refused) is retried for the same transfer on
another prefill: decode gets its KV, the client its answer, the record says ``attempts: 2``."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.proxy.conftest import Cluster, sample


@pytest.mark.parametrize("flow", ["decode_first", "concurrent"])
def test_a_refused_prefill_is_retried_on_the_other(
    make_cluster: Callable[..., Cluster], flow: str
) -> None:
    c = make_cluster(n_prefill=2, n_decode=1).start_proxy(flow=flow, prefill_policy="round_robin")
    p0, p1 = c.prefill
    p0.stop()  # healthy at the startup probe, refusing connections now
    r = c.post(prompt="x")
    assert r.status_code == 200 and r.content == c.decode[0].answers[-1]
    tid = r.headers["x-kv-transfer-id"]
    rec = c.record(tid)
    assert (rec["status"], rec["attempts"], rec["prefill"]) == ("ok", 2, p1.url), rec
    (retry,) = rec["retries"]
    assert (retry["stage"], retry["reason"], retry["instance"]) == ("prefill", "connect", p0.url)
    assert retry["transfer_id"] == tid and retry["error"].startswith(
        f"prefill instance {p0.url} failed: Connect"
    )
    assert rec["error"] is None  # the failure is the retry's, not the request's
    # The same transfer, its same token: decode's KV came from p1 before it answered.
    (seen,) = p1.requests
    assert seen.body["kv_transfer_params"]["transfer_id"] == tid
    assert c.decode[0].prefill_first[tid] is True
    assert sample(c.metrics(), "kvproxy_retries_total", stage="prefill", reason="connect") == 1


def test_a_prefill_that_answered_is_not_retried(make_cluster: Callable[..., Cluster]) -> None:
    # It may have claimed decode's blocks, which take one prefill per transfer.
    c = make_cluster(n_prefill=2, n_decode=1).start_proxy(prefill_policy="round_robin")
    p0, p1 = c.prefill
    p0.behaviour.status = 500
    c.decode[0].behaviour.prefill_wait_s = 0.2
    rec = c.record(c.post(prompt="x").headers["x-kv-transfer-id"])
    assert (rec["status"], rec["attempts"], rec["prefill_status"]) == ("prefill_failed", 1, 500)
    assert not p1.requests
