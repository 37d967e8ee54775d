"""The decode-first contract: what decode and prefill receive, in which order, and the answer."""

from __future__ import annotations

from tests.proxy.conftest import TARGET_BLOCKS, Cluster


def test_decode_posts_target_then_prefill_gets_it_then_decode_answers(cluster: Cluster) -> None:
    d, p = cluster.decode[0], cluster.prefill[0]
    r = cluster.post(prompt=[1, 2, 3], max_tokens=16, temperature=0)
    assert r.status_code == 200, r.text
    tid = r.headers["x-kv-transfer-id"]

    # Decode got the client's body plus the transfer params pointing back at the proxy, with
    # the transfer's token (prefill gets the same one).
    (seen_d,) = d.requests
    token = seen_d.body["kv_transfer_params"]["transfer_token"]
    assert isinstance(token, str) and len(token) >= 43
    assert seen_d.path == "/v1/completions"
    assert seen_d.body == {
        "model": "tiny",
        "prompt": [1, 2, 3],
        "max_tokens": 16,
        "temperature": 0,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "transfer_id": tid,
            "router_url": f"{cluster.url}/v1/kv_targets",
            "transfer_token": token,
            # The call's trace context, also in the header (vLLM's own OTel may be off).
            "traceparent": seen_d.headers["traceparent"],
        },
    }
    # The proxy took decode's target, and prefill had the prompt before decode answered.
    ((posted, status, answer),) = d.posts
    assert (status, answer) == (200, {"ok": True})
    assert d.prefill_first == {tid: True}

    # Prefill got the prompt for one token, not streamed, pushing to exactly that target.
    (seen_p,) = p.requests
    assert seen_p.path == "/v1/completions"
    assert seen_p.body == {
        "model": "tiny",
        "prompt": [1, 2, 3],
        "max_tokens": 1,
        "temperature": 0,
        "stream": False,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "transfer_id": tid,
            "remote": posted["target"],
            "transfer_token": token,
            "traceparent": seen_p.headers["traceparent"],
        },
    }
    assert seen_p.body["kv_transfer_params"]["remote"]["block_ids"] == TARGET_BLOCKS

    # The client's answer is decode's, byte for byte (its kv_transfer_params included).
    assert r.content == d.answers[-1]
    assert r.headers["content-type"] == "application/json"
    assert r.json()["kv_transfer_params"] == {"echo": tid}

    rec = cluster.record(tid)
    assert rec["status"] == "ok", rec
    assert (rec["decode"], rec["prefill"]) == (d.url, p.url)
    assert rec["decode_status"] == rec["prefill_status"] == 200
    assert 0 < rec["target_ms"] <= rec["total_ms"]
    assert rec["prefill_ms"] > 0


def test_chat_prefill_is_capped_at_one_token_both_ways(cluster: Cluster) -> None:
    r = cluster.post(
        "/v1/chat/completions",
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=50,
        max_tokens=50,
        min_tokens=5,
        # A client cannot steer transfers: its own params are replaced.
        kv_transfer_params={"do_remote_decode": True, "remote": {"host": "evil"}},
    )
    assert r.status_code == 200, r.text
    tid = r.headers["x-kv-transfer-id"]
    (seen_d,) = cluster.decode[0].requests
    assert seen_d.path == "/v1/chat/completions"
    assert seen_d.body["max_completion_tokens"] == 50
    assert seen_d.body["min_tokens"] == 5
    assert seen_d.body["kv_transfer_params"]["do_remote_prefill"] is True
    assert "remote" not in seen_d.body["kv_transfer_params"]
    (seen_p,) = cluster.prefill[0].requests
    assert seen_p.path == "/v1/chat/completions"
    assert seen_p.body["max_completion_tokens"] == seen_p.body["max_tokens"] == 1
    assert "min_tokens" not in seen_p.body  # vLLM refuses min_tokens > max_tokens
    assert seen_p.body["kv_transfer_params"]["transfer_id"] == tid
    assert seen_p.body["kv_transfer_params"]["remote"]["host"] == "127.0.0.1"


def test_authorization_reaches_both_engines(cluster: Cluster) -> None:
    r = cluster.client.post(
        f"{cluster.url}/v1/completions",
        json={"model": "tiny", "prompt": "x"},
        headers={"Authorization": "Bearer sk-test"},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    assert cluster.decode[0].requests[0].headers["authorization"] == "Bearer sk-test"
    assert cluster.prefill[0].requests[0].headers["authorization"] == "Bearer sk-test"


def test_bad_body_is_400(cluster: Cluster) -> None:
    r = cluster.client.post(f"{cluster.url}/v1/completions", content=b"[1, 2", timeout=5)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = cluster.client.post(f"{cluster.url}/v1/completions", json=[1, 2], timeout=5)
    assert r.status_code == 400
    assert not cluster.decode[0].requests
