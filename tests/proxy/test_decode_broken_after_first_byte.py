"""A stream that breaks after the client received its first event is not retried (the client
holds part of one answer): it ends with an error event, as vLLM reports errors mid-stream."""

from __future__ import annotations

import json
from collections.abc import Callable

from tests.proxy.conftest import Cluster, sample


def test_a_stream_broken_after_its_first_event_ends_with_an_error_event(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster(n_prefill=1, n_decode=2).start_proxy(decode_policy="round_robin")
    d0, d1 = c.decode
    d0.behaviour.break_after = 1
    r = c.post(prompt="x", stream=True)
    assert r.status_code == 200
    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
    assert json.loads(events[0])["served_by"] == "d0"
    error = json.loads(events[-1])["error"]
    assert (error["code"], error["type"]) == (502, "bad_gateway")
    assert error["message"].startswith(f"decode instance {d0.url} broke off its answer")
    assert len(events) == 2  # the one event d0 sent, then the error: no [DONE]
    assert not d1.requests  # not retried
    rec = c.record(r.headers["x-kv-transfer-id"])
    assert (rec["status"], rec["attempts"], rec["retried_as"]) == ("decode_failed", 1, None)
    assert sample(c.metrics(), "kvproxy_retries_total", stage="decode", reason="reset") is None
