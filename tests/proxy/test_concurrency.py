"""Many requests at once: each prefill gets the target its own decode posted, nothing leaks."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tests.proxy.conftest import Cluster


def test_concurrent_requests_pair_each_prefill_with_its_own_target(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster(n_prefill=2, n_decode=2).start_proxy(policy="least_outstanding")
    for d in c.decode:
        d.behaviour.chunks, d.behaviour.chunk_delay_s = 3, 0.02
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda i: c.post(prompt=f"p{i}", stream=i % 2 == 0), range(32)))
    assert [a.status_code for a in answers] == [200] * 32
    tids = {a.headers["x-kv-transfer-id"] for a in answers}
    assert len(tids) == 32

    posted = {body["transfer_id"]: body["target"] for d in c.decode for body, _, _ in d.posts}
    got = {
        s.body["kv_transfer_params"]["transfer_id"]: s.body["kv_transfer_params"]["remote"]
        for p in c.prefill
        for s in p.requests
    }
    assert set(posted) == set(got) == tids
    assert all(got[tid] == posted[tid] for tid in tids)
    assert all(c.record(tid)["status"] == "ok" for tid in tids)
    h = c.get("/health").json()
    assert all(i["outstanding"] == 0 for i in h["decode"] + h["prefill"])
    assert all(i["served"] > 0 for i in h["decode"] + h["prefill"])
