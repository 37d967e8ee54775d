"""A decode that fails before the client received a byte (refused, 5xx, a stream broken
before its first event) is retried once, as a new transfer, on another decode: the client gets
the other decode's answer, and both records say what happened."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.proxy.conftest import Cluster, FakeVLLM, sample


def _stop(d: FakeVLLM) -> None:
    d.stop()  # healthy at the startup probe, refusing connections now


def _answer_500(d: FakeVLLM) -> None:
    d.behaviour.status = 500


def _die_before_first_event(d: FakeVLLM) -> None:
    d.behaviour.break_after = 0  # headers out, then the connection breaks


@pytest.mark.parametrize(
    ("fail", "stream", "reason"),
    [
        (_stop, False, "connect"),
        (_stop, True, "connect"),
        (_answer_500, False, "status_5xx"),
        (_die_before_first_event, True, "reset"),
    ],
)
def test_a_decode_failing_before_the_first_byte_is_retried_on_the_other(
    make_cluster: Callable[..., Cluster],
    fail: Callable[[FakeVLLM], None],
    stream: bool,
    reason: str,
) -> None:
    c = make_cluster(n_prefill=1, n_decode=2).start_proxy(decode_policy="round_robin")
    d0, d1 = c.decode
    fail(d0)
    r = c.post(prompt="x", stream=stream)
    assert r.status_code == 200, r.text
    assert r.content == d1.answers[-1]  # the other decode's whole answer, nothing of d0's
    tid = r.headers["x-kv-transfer-id"]
    rec = c.record(tid)
    assert (rec["status"], rec["decode"], rec["attempts"]) == ("ok", d1.url, 2), rec
    (retry,) = rec["retries"]
    assert (retry["stage"], retry["reason"], retry["instance"]) == ("decode", reason, d0.url)
    # The failed attempt's transfer: its own id, ended, naming the one that went on.
    old = c.record(retry["transfer_id"])
    assert old["transfer_id"] != tid
    assert (old["status"], old["retried_as"], old["decode"]) == ("decode_failed", tid, d0.url)
    # The retry is a new transfer: prefill was asked again, with the new id and a new token.
    kvs: list[dict[str, Any]] = [s.body["kv_transfer_params"] for s in c.prefill[0].requests]
    assert [kv["transfer_id"] for kv in kvs][-1] == tid
    assert d1.prefill_first[tid] is True
    s = c.metrics()
    assert sample(s, "kvproxy_retries_total", stage="decode", reason=reason) == 1
    # One client request, counted once.
    requests = [v for (name, _), v in s.items() if name == "kvproxy_requests_total"]
    assert requests == [1.0]


def test_a_decode_failing_with_no_other_decode_is_answered_502(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster(n_prefill=1, n_decode=1).start_proxy()
    c.decode[0].stop()
    r = c.post(prompt="x")
    assert r.status_code == 502
    assert c.record(r.headers["x-kv-transfer-id"])["attempts"] == 1
    s = c.metrics()
    assert sample(s, "kvproxy_retries_refused_total", stage="decode", why="no_instance") == 1
