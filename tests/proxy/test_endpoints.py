"""GET /v1/models (relayed from a healthy decode) and GET /v1/transfers (recent records)."""

from __future__ import annotations

from collections.abc import Callable

from tests.proxy.conftest import Cluster


def test_models_come_from_the_first_healthy_decode(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster(n_prefill=1, n_decode=2)
    c.decode[0].behaviour.health_status = 503
    c.start_proxy()
    r = c.get("/v1/models")
    assert r.status_code == 200
    assert r.json() == {"object": "list", "data": [{"id": "tiny", "owned_by": "d1"}]}


def test_models_from_an_unreachable_decode_is_502(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster().start_proxy()
    c.decode[0].stop()
    r = c.get("/v1/models")
    assert r.status_code == 502
    assert c.decode[0].url in r.json()["error"]["message"]


def test_transfers_lists_recent_ones_oldest_first(cluster: Cluster) -> None:
    tids = [cluster.post(prompt=str(i)).headers["x-kv-transfer-id"] for i in range(3)]
    for tid in tids:
        cluster.record(tid)  # settled
    listed = cluster.get("/v1/transfers").json()["transfers"]
    assert [t["transfer_id"] for t in listed] == tids
    assert set(listed[0]) >= {
        "transfer_id",
        "decode",
        "prefill",
        "target_ms",
        "prefill_ms",
        "total_ms",
        "status",
    }
    assert all(t["status"] == "ok" and t["prefill_ms"] > 0 for t in listed)
    last = cluster.get("/v1/transfers?limit=1").json()["transfers"]
    assert [t["transfer_id"] for t in last] == tids[-1:]
    assert cluster.get("/v1/transfers/unknown").status_code == 404
