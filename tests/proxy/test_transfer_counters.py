"""Counters an operator alerts on: transfers that failed and prompts decode computed itself,
per decode instance (``kvproxy_num_failed_transfers``, ``kvproxy_decode_prompts``)."""

from __future__ import annotations

from collections.abc import Callable

from tests.proxy.conftest import Cluster, sample


def test_failed_transfers_and_recomputed_prompts_are_counted_per_instance(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster(n_prefill=1, n_decode=2).start_proxy(decode_policy="round_robin")
    (p,), (d0, d1) = c.prefill, c.decode
    d1.behaviour.kv_load = "failed"  # its loads fail: it recomputes
    for prompt in ("a", "b"):  # d0, then d1
        c.record(c.post(prompt=prompt).headers["x-kv-transfer-id"])
    p.behaviour.status, p.behaviour.delivers = 500, False
    d0.behaviour.prefill_wait_s = 0.2
    rec = c.record(c.post(prompt="c").headers["x-kv-transfer-id"])  # d0: prefill fails
    assert (rec["decode"], rec["status"]) == (d0.url, "prefill_failed")
    s = c.metrics()
    prompts = {
        (k["instance"], k["source"]): v
        for (name, labels), v in s.items()
        if name == "kvproxy_decode_prompts_total"
        for k in [dict(labels)]
    }
    assert prompts == {
        (d0.url, "transfer"): 1,
        (d0.url, "recomputed"): 1,
        (d1.url, "recomputed"): 1,
    }
    failed = "kvproxy_num_failed_transfers_total"
    assert sample(s, failed, instance=d1.url, status="recomputed") == 1
    assert sample(s, failed, instance=d0.url, status="prefill_failed") == 1
    assert sample(s, failed, instance=d0.url, status="recomputed") is None
