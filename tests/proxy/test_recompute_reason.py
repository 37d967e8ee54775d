"""A recomputed transfer says why, as decode's connector put it beside ``kv_load: "failed"``
(issue 51): ``kv_digest_mismatch`` when decode's sidecar found the KV's digest differs from
prefill's, in the record (``recompute_reason``) and in ``kvproxy_recomputes_total``."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from app.proxy.bodies import kv_load_error_of
from tests.proxy.conftest import Cluster, sample


@pytest.mark.parametrize(
    ("said", "reason"),
    [
        ("kv_digest_mismatch", "kv_digest_mismatch"),
        ("transfer_failed", "transfer_failed"),
        (None, "unreported"),  # a connector that says no reason
        ("something new", "unreported"),  # not a reason the proxy knows: no new label
    ],
)
def test_a_recomputed_record_names_why(
    make_cluster: Callable[..., Cluster], said: str | None, reason: str
) -> None:
    c = make_cluster().start_proxy()
    d = c.decode[0]
    d.behaviour.kv_load, d.behaviour.kv_load_error = "failed", said
    r = c.post(prompt="x")
    assert r.status_code == 200 and r.content == d.answers[-1]  # relayed as it came
    rec = c.record(r.headers["x-kv-transfer-id"])
    assert (rec["status"], rec["recompute_reason"]) == ("recomputed", reason), rec
    s = c.metrics()
    assert sample(s, "kvproxy_recomputes_total", instance=d.url, reason=reason) == 1
    assert sample(s, "kvproxy_transfers_total", outcome="recomputed") == 1


def test_only_a_recompute_has_a_reason(make_cluster: Callable[..., Cluster]) -> None:
    """A load that went well names no reason, even if a stray ``kv_load_error`` came with it."""
    c = make_cluster().start_proxy()
    d = c.decode[0]
    d.behaviour.kv_load, d.behaviour.kv_load_error = "ok", "kv_digest_mismatch"
    rec = c.record(c.post(prompt="x").headers["x-kv-transfer-id"])
    assert (rec["status"], rec["recompute_reason"]) == ("ok", None), rec
    assert not [k for k in c.metrics() if k[0] == "kvproxy_recomputes_total"]


def test_the_reason_is_read_leniently() -> None:
    def answer(params: object) -> bytes:
        return json.dumps({"choices": [], "kv_transfer_params": params}).encode()

    failed = {"kv_load": "failed", "kv_load_error": "kv_digest_mismatch"}
    assert kv_load_error_of(answer(failed)) == "kv_digest_mismatch"
    for content in (
        answer({**failed, "kv_load": "ok"}),  # only beside a failed load
        answer({**failed, "kv_load_error": 1}),
        answer({**failed, "kv_load_error": "x" * 10_000}),
        answer(None),
        json.dumps(failed).encode(),  # not inside kv_transfer_params
        b'not json "kv_load_error"',
        b"",
    ):
        assert kv_load_error_of(content) is None, content[:40]
