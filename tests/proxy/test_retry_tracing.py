"""A retried request is one trace: one server span, a client span per call to decode (the
failed one in error), the server span ended once, by the attempt that answered."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.proxy.conftest import Cluster
from tests.tracing.otlp import OtlpReceiver
from tests.tracing.otlp import otlp as otlp  # the fixture


def test_a_decode_retry_is_one_server_span_with_two_decode_calls(
    otlp: OtlpReceiver,
    make_cluster: Callable[..., Cluster],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", otlp.endpoint)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    c = make_cluster(n_prefill=1, n_decode=2).start_proxy(decode_policy="round_robin")
    c.decode[0].behaviour.status = 500
    r = c.post(prompt="x")
    assert r.status_code == 200
    tid = r.headers["x-kv-transfer-id"]
    spans = otlp.wait("a server span", lambda s: any(x.name == "POST /v1/completions" for x in s))
    (server,) = [s for s in spans if s.name == "POST /v1/completions"]
    spans = otlp.wait("both decode calls", lambda s: sum(x.name.endswith("decode") for x in s) >= 2)
    calls = sorted((s for s in spans if s.name.endswith("decode")), key=lambda s: s.start_ns)
    assert [bool(s.error) for s in calls] == [True, False]
    assert {s.parent_id for s in calls} == {server.span_id}
    assert server.attributes["kv.transfer_id"] == tid and not server.error
    assert server.start_ns <= calls[0].start_ns <= calls[1].end_ns <= server.end_ns
