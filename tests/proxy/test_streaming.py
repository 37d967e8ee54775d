"""A streamed answer is decode's stream, relayed chunk by chunk and in order."""

from __future__ import annotations

import time

from tests.proxy.conftest import Cluster


def test_stream_relays_every_chunk_in_order(cluster: Cluster) -> None:
    d, p = cluster.decode[0], cluster.prefill[0]
    d.behaviour.chunks, d.behaviour.chunk_delay_s = 6, 0.05
    body = {
        "model": "tiny",
        "prompt": "hello",
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    arrivals: list[float] = []
    got = bytearray()
    with cluster.client.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=10) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        tid = r.headers["x-kv-transfer-id"]
        for chunk in r.iter_raw():
            got += chunk
            arrivals.append(time.monotonic())

    assert bytes(got) == d.answers[-1]  # every byte, in order, nothing added
    events = bytes(got).decode().split("\n\n")
    assert [e for e in events if e][-1] == "data: [DONE]"
    assert [e.count("tok") for e in events[:6]] == [1] * 6
    assert [f"tok{i}" in e for i, e in enumerate(events[:6])] == [True] * 6
    # Relayed as they came, not buffered to the end: the first arrived well before the last.
    assert arrivals[-1] - arrivals[0] > 0.15

    # Decode streams (the client's flag is kept); prefill does not, and has no stream_options.
    assert d.requests[0].body["stream"] is True
    assert d.requests[0].body["stream_options"] == {"include_usage": True}
    assert p.requests[0].body["stream"] is False
    assert "stream_options" not in p.requests[0].body
    assert p.requests[0].body["max_tokens"] == 1
    assert cluster.record(tid)["status"] == "ok"
