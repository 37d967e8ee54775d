"""What a client can make the proxy hold is bounded: a body (413, and 408 when it dawdles),
requests in flight (503 with Retry-After, never on /health), a transfer id's length (400, not
echoed), and the weight of ``max_tokens`` in routing (what fits after the prompt)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tests.proxy.conftest import Cluster


def test_body_over_the_cap_is_413_and_never_forwarded(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster().start_proxy(max_body_bytes=64 << 10)
    r = c.post(prompt="x" * (128 << 10), max_tokens=4)
    assert r.status_code == 413, r.text
    assert r.json()["error"]["message"].endswith("expected at most 65536 bytes (--max-body-bytes)")
    assert c.decode[0].requests == [] and c.prefill[0].requests == []
    assert c.post(prompt=[1, 2, 3], max_tokens=4).status_code == 200


def test_requests_over_the_inflight_cap_get_503_and_health_still_answers(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster()
    gate = threading.Event()
    c.decode[0].behaviour.hold = gate  # decode answers only once the gate opens
    c.start_proxy(max_inflight=2)
    with ThreadPoolExecutor(2) as pool:
        held = [pool.submit(c.post, prompt=[1, 2, 3], max_tokens=4) for _ in range(2)]
        try:
            for _ in range(100):
                if len(c.decode[0].requests) == 2:
                    break
                threading.Event().wait(0.05)
            over = c.post(prompt=[4, 5, 6], max_tokens=4)
            health = c.get("/health")
        finally:
            gate.set()
        answers = [f.result() for f in held]
    assert over.status_code == 503, over.text
    assert over.headers["retry-after"] == "1"
    assert "in flight" in over.json()["error"]["message"]
    assert health.status_code == 200
    assert [a.status_code for a in answers] == [200, 200]


def test_transfer_id_is_bounded_and_not_echoed(cluster: Cluster) -> None:
    huge = "t" * (1 << 20)
    r = cluster.client.post(
        f"{cluster.url}/v1/kv_targets", json={"transfer_id": huge, "target": {}}, timeout=10
    )
    assert r.status_code == 400 and len(r.content) < 1000, r.text[:200]
    g = cluster.client.get(f"{cluster.url}/v1/kv_targets/{'t' * 300}", timeout=10)
    assert g.status_code == 400 and "t" * 300 not in g.text


def test_max_tokens_weighs_only_what_fits_after_the_prompt(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster(n_decode=2)
    gate = threading.Event()
    for d in c.decode:
        d.behaviour.hold = gate
    c.start_proxy(max_model_len=1000)
    with ThreadPoolExecutor(1) as pool:
        greedy = pool.submit(c.post, prompt=[1] * 100, max_tokens=10**15)
        try:
            for _ in range(100):
                health = c.get("/health").json()
                loads = [i["tokens_in_flight"] for i in health["decode"]]
                if any(loads):
                    break
                threading.Event().wait(0.05)
        finally:
            gate.set()
        assert greedy.result().status_code == 200
    # Prompt 100 + max_tokens clamped to the 900 left of the model's 1000.
    assert sorted(loads) == [0, 1000], health["decode"]


def test_slow_body_gets_408(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster().start_proxy(body_timeout_s=0.5)
    host, port = c.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{"
        )
        answer = s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert c.decode[0].requests == []
