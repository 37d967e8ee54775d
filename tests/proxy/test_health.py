"""Health: probed before serving and every interval; 503 when a whole side is down."""

from __future__ import annotations

from collections.abc import Callable

from tests.proxy.conftest import Cluster, wait_for


def test_health_lists_every_instance(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster(n_prefill=1, n_decode=2).start_proxy()
    r = c.get("/health")
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok"
    assert [i["url"] for i in body["prefill"]] == [c.prefill[0].url]
    assert [i["url"] for i in body["decode"]] == [d.url for d in c.decode]
    assert all(i["healthy"] and i["health"] == "healthy" for i in body["decode"])
    assert all(i["outstanding"] == 0 for i in body["decode"] + body["prefill"])


def test_all_decodes_unhealthy_is_503_naming_them(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster(n_prefill=1, n_decode=2)
    for d in c.decode:
        d.behaviour.health_status = 503
    c.start_proxy()
    r = c.post(prompt="x")
    assert r.status_code == 503
    urls = ", ".join(d.url for d in c.decode)
    assert r.json() == {
        "error": {
            "message": f"no healthy decode instance (tried: {urls})",
            "type": "service_unavailable",
            "code": 503,
        }
    }
    assert not any(f.requests for f in (*c.decode, *c.prefill))
    h = c.get("/health")
    assert h.status_code == 503
    assert h.json()["status"] == "unavailable"
    assert h.json()["decode"][0]["last_error"] == "GET /health answered 503"
    assert c.get("/v1/models").status_code == 503


def test_all_prefills_unhealthy_is_503_when_told_to_refuse(
    make_cluster: Callable[..., Cluster],
) -> None:
    """--without-prefill refuse (the default serves decode alone: test_no_prefill.py)."""
    c = make_cluster(n_prefill=1, n_decode=1)
    c.prefill[0].behaviour.health_status = 500
    c.start_proxy(without_prefill="refuse")
    r = c.post(prompt="x")
    assert r.status_code == 503
    assert r.json()["error"]["message"] == (
        f"no healthy prefill instance (tried: {c.prefill[0].url})"
    )
    assert not c.decode[0].requests  # nothing was started on decode either
    assert c.get("/health").status_code == 503
    assert c.get("/health").json()["decode"][0]["outstanding"] == 0


def test_probes_follow_an_instance_down_and_up(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster(n_prefill=1, n_decode=1).start_proxy(health_interval_s=0.1)
    assert c.get("/health").status_code == 200
    c.decode[0].behaviour.health_status = 503
    wait_for("decode to be marked unhealthy", lambda: c.get("/health").status_code == 503)
    assert c.post(prompt="x").status_code == 503
    c.decode[0].behaviour.health_status = 200
    wait_for("decode to be healthy again", lambda: c.get("/health").status_code == 200)
    assert c.post(prompt="x").status_code == 200
