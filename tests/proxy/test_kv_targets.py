"""The target callback's answers to malformed, unknown and repeated posts."""

from __future__ import annotations

from tests.proxy.conftest import Cluster


def test_unknown_transfer_is_401_with_a_sentence(cluster: Cluster) -> None:
    """As a live id without its token (test_kv_target_refusals.py): nothing tells them apart."""
    r = cluster.client.post(
        f"{cluster.url}/v1/kv_targets", json={"transfer_id": "nope", "target": {"a": 1}}
    )
    assert r.status_code == 401
    assert r.json()["error"]["message"].startswith("this transfer needs its token")


def test_malformed_posts_are_400(cluster: Cluster) -> None:
    bodies: list[dict[str, object]] = [
        {"target": {}},
        {"transfer_id": 3, "target": {}},
        {"transfer_id": "t"},
        {"transfer_id": "t", "target": [1]},
    ]
    for body in bodies:
        r = cluster.client.post(f"{cluster.url}/v1/kv_targets", json=body)
        assert r.status_code == 400, body
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_second_post_for_a_transfer_is_409(cluster: Cluster) -> None:
    r = cluster.post(prompt="x")
    tid = r.headers["x-kv-transfer-id"]
    token = cluster.decode[0].requests[0].body["kv_transfer_params"]["transfer_token"]
    again = cluster.client.post(
        f"{cluster.url}/v1/kv_targets",
        json={"transfer_id": tid, "target": {"x": 1}},
        headers={"x-kv-transfer-token": token},
    )
    assert again.status_code == 409
    assert "no longer waiting: its target already arrived" in again.json()["error"]["message"]
