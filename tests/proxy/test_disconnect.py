"""A client that goes away closes both upstream connections (vLLM then aborts both)."""

from __future__ import annotations

import httpx
import pytest

from tests.proxy.conftest import Cluster, wait_for


def test_client_leaving_mid_stream_closes_decode_and_prefill(cluster: Cluster) -> None:
    d, p = cluster.decode[0], cluster.prefill[0]
    d.behaviour.chunks, d.behaviour.chunk_delay_s = 200, 0.05
    p.behaviour.delay_s = 30  # prefill still busy when the client leaves
    body = {"model": "tiny", "prompt": "x", "stream": True}
    with cluster.client.stream("POST", f"{cluster.url}/v1/completions", json=body) as r:
        tid = r.headers["x-kv-transfer-id"]
        chunks = r.iter_raw()
        assert next(chunks).startswith(b"data: ")
        assert next(chunks)
    # Leaving the block closed the connection with the stream unfinished.
    assert d.disconnected.wait(5), "decode's stream was not cancelled"
    assert p.disconnected.wait(5), "prefill's request was not closed"
    assert d.answers[-1].count(b"data: ") < 50
    rec = cluster.record(tid)
    assert rec["status"] == "client_gone"
    h = cluster.get("/health").json()
    assert h["decode"][0]["outstanding"] == h["prefill"][0]["outstanding"] == 0


def test_client_leaving_while_decode_computes_closes_both(cluster: Cluster) -> None:
    d, p = cluster.decode[0], cluster.prefill[0]
    d.behaviour.delay_s = 30  # a non-streamed answer: nothing comes back until the end
    p.behaviour.delay_s = 30
    with pytest.raises(httpx.ReadTimeout):
        cluster.post(prompt="x", timeout=0.5)
    assert d.disconnected.wait(5), "decode's request was not closed"
    assert p.disconnected.wait(5), "prefill's request was not closed"
    tid = cluster.get("/v1/transfers").json()["transfers"][-1]["transfer_id"]
    assert cluster.record(tid)["status"] == "client_gone"
    wait_for(
        "leases to be released",
        lambda: cluster.get("/health").json()["decode"][0]["outstanding"] == 0,
    )
