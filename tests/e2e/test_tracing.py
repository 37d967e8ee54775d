"""The sidecars' spans of real transfers (separate processes, real Mooncake writes), exported
over OTLP/HTTP to a receiver in this process: parent links and timing order.

The test plays the proxy: it gives decode's request the traceparent of a "decode call" span
and prefill's that of a "prefill call" span of one trace, as the proxy injects them
(tests/proxy/test_tracing.py checks the proxy's side)."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from app.sim.cluster import Cluster
from app.sim.rounds import summarize
from app.tracing.traceparent import new_trace
from tests.tracing.otlp import OtlpReceiver, ReceivedSpan
from tests.tracing.otlp import otlp as otlp  # the fixture

LENS = [300, 200]  # chunked in 128s: three and two steps


def test_send_recv_and_layer_write_spans_link_under_the_proxy_calls(
    otlp: OtlpReceiver, make_cluster: Callable[..., Cluster]
) -> None:
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": otlp.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50"}
    cluster = make_cluster(
        model="llama-3.1-8b",
        layers=4,
        prefill_tp=2,
        decode_tp=1,
        max_requests=len(LENS),
        max_prompt=max(LENS),
        sidecar_env=env,
    )
    pairs = cluster.make_requests(LENS)
    server = new_trace()  # the proxy's server span
    calls = {}
    lens = {pr.id: pr.prompt_len for pr, _ in pairs}
    for pr, dr in pairs:
        to_d, to_p = server.child(), server.child()  # the proxy's decode / prefill call spans
        pr.traceparent, dr.traceparent = to_p.header, to_d.header
        calls[pr.id] = (to_d, to_p)
    s = summarize(cluster.run(pairs, chunk=128, compute_ms=2), pairs)
    assert s["failures"] == {} and s["verified"] == len(LENS)

    # Each request: one recv span (D TP 1) and one send span per P rank (TP 2).
    want = len(LENS) * (1 + 2)
    spans = otlp.wait(
        f"{want} transfer spans", lambda got: _count(got, "kv.send", "kv.recv") >= want
    )
    assert {sp.trace_id for sp in spans} == {server.trace_id}
    assert {sp.service for sp in spans} == {"kv-sidecar-prefill", "kv-sidecar-decode"}
    for rid, (to_d, to_p) in calls.items():
        mine = [sp for sp in spans if sp.attributes.get("kv.request") == rid]
        (recv,) = [sp for sp in mine if sp.name == "kv.recv"]
        sends = [sp for sp in mine if sp.name == "kv.send"]
        assert recv.parent_id == to_d.span_id and recv.service == "kv-sidecar-decode"
        assert recv.attributes["kv.state"] == "DONE" and not recv.error
        assert sorted(sp.attributes["kv.rank"] for sp in sends) == [0, 1]
        last_write_end = 0
        for send in sends:
            assert send.parent_id == to_p.span_id and send.service == "kv-sidecar-prefill"
            assert send.attributes["kv.state"] == "DONE" and not send.error
            writes = sorted(
                (
                    sp
                    for sp in spans
                    if sp.name == "kv.layer_write" and sp.parent_id == send.span_id
                ),
                key=lambda sp: sp.start_ns,
            )
            steps = sorted({w.attributes["kv.step"] for w in writes})
            assert len(steps) == -(-lens[rid] // 128), steps  # one per chunk
            for step in steps:
                layers = [
                    w.attributes["kv.layer"] for w in writes if w.attributes["kv.step"] == step
                ]
                assert layers == [0, 1, 2, 3], (rid, step, layers)  # in layer order, each once
            for w in writes:
                assert send.start_ns <= w.start_ns <= w.end_ns <= send.end_ns
                assert w.attributes["kv.bytes"] > 0
            assert sum(w.attributes["kv.bytes"] for w in writes) == send.attributes["kv.bytes"]
            last_write_end = max(last_write_end, writes[-1].end_ns)
        # Decode expected before prefill's last write landed, and was done only after it.
        assert recv.start_ns < last_write_end <= recv.end_ns

    # The admin API shows each rank's traceparent with the request.
    for side, index in (("decode", 0), ("prefill", 1)):
        url = cluster.sides[side].admin_url
        for rid, tps in calls.items():
            entries = httpx.get(f"{url}/v1/requests/{rid}", timeout=5).json()["entries"]
            assert entries and {e["traceparent"] for e in entries} == {tps[index].header}


def _count(spans: list[ReceivedSpan], *names: str) -> int:
    return sum(sp.name in names for sp in spans)
