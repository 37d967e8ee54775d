"""The proxy's trace: the client's traceparent → the proxy's server span → one client span per
call to decode and prefill, whose context each upstream gets as the header and in
``kv_transfer_params``; spans exported over OTLP/HTTP to a real receiver in this process."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from app.proxy import Flow
from app.tracing.traceparent import parse
from tests.proxy.conftest import Cluster
from tests.tracing.otlp import OtlpReceiver, ReceivedSpan
from tests.tracing.otlp import otlp as otlp  # the fixture

CLIENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
CLIENT_TRACE, CLIENT_SPAN = CLIENT[3:35], CLIENT[36:52]
SERVER, CLIENT_KIND = 2, 3  # OTLP span kinds


def _one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, [s.name for s in spans]
    return found[0]


@pytest.mark.parametrize("flow", [Flow.DECODE_FIRST, Flow.CONCURRENT])
def test_spans_chain_client_proxy_and_both_upstreams(
    otlp: OtlpReceiver,
    make_cluster: Callable[..., Cluster],
    monkeypatch: pytest.MonkeyPatch,
    flow: Flow,
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", otlp.endpoint)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    c = make_cluster().start_proxy(flow=flow)
    d, p = c.decode[0], c.prefill[0]
    r = c.client.post(
        f"{c.url}/v1/completions",
        json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4},
        headers={"traceparent": CLIENT},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-kv-trace-id"] == CLIENT_TRACE
    tid = r.headers["x-kv-transfer-id"]
    assert c.record(tid)["trace_id"] == CLIENT_TRACE

    # What each upstream got: the same traceparent as the header and in the params.
    (seen_d,), (seen_p,) = d.requests, p.requests
    to_d, to_p = parse(seen_d.headers["traceparent"]), parse(seen_p.headers["traceparent"])
    assert to_d is not None and to_p is not None
    assert seen_d.body["kv_transfer_params"]["traceparent"] == to_d.header
    assert seen_p.body["kv_transfer_params"]["traceparent"] == to_p.header
    assert to_d.trace_id == to_p.trace_id == CLIENT_TRACE
    assert len({to_d.span_id, to_p.span_id, CLIENT_SPAN}) == 3

    spans = otlp.wait("the proxy's three spans", lambda s: len(s) >= 3)
    server = _one(spans, "POST /v1/completions")
    call_d = _one(spans, "POST /v1/completions decode")
    call_p = _one(spans, "POST /v1/completions prefill")
    assert {s.trace_id for s in spans} == {CLIENT_TRACE}
    assert {s.service for s in spans} == {"kv-sidecar-proxy"}
    # Parent links: client → server span → each call; each upstream got its call's id.
    assert (server.parent_id, server.kind) == (CLIENT_SPAN, SERVER)
    assert call_d.parent_id == call_p.parent_id == server.span_id
    assert call_d.kind == call_p.kind == CLIENT_KIND
    assert (call_d.span_id, call_p.span_id) == (to_d.span_id, to_p.span_id)
    assert call_d.attributes["kv.transfer_id"] == tid == server.attributes["kv.transfer_id"]
    assert not any(s.error for s in spans)
    # Timing: both calls inside the request (decode answers only once prefill had it).
    assert server.start_ns <= call_d.start_ns <= call_d.end_ns <= server.end_ns
    assert server.start_ns <= call_p.start_ns <= call_p.end_ns
    assert call_d.start_ns <= call_p.start_ns if flow is Flow.DECODE_FIRST else True


def test_without_an_endpoint_the_context_is_still_carried(
    make_cluster: Callable[..., Cluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    c = make_cluster().start_proxy()
    d, p = c.decode[0], c.prefill[0]
    # No traceparent from the client, then a malformed one: both start a new trace.
    for headers in ({}, {"traceparent": CLIENT.upper()}):
        r = c.client.post(
            f"{c.url}/v1/completions",
            json={"model": "tiny", "prompt": "x"},
            headers=headers,
            timeout=10,
        )
        assert r.status_code == 200
        trace = r.headers["x-kv-trace-id"]
        to_d = parse(d.requests[-1].headers["traceparent"])
        to_p = parse(p.requests[-1].headers["traceparent"])
        assert to_d is not None and to_p is not None
        assert to_d.trace_id == to_p.trace_id == trace != CLIENT_TRACE
        assert d.requests[-1].body["kv_transfer_params"]["traceparent"] == to_d.header
        assert c.record(r.headers["x-kv-transfer-id"])["trace_id"] == trace
    # A refusal the proxy gives itself names its trace too.
    r = c.client.post(f"{c.url}/v1/completions", content=b"{", headers={"traceparent": CLIENT})
    assert r.status_code == 400 and r.headers["x-kv-trace-id"] == CLIENT_TRACE
