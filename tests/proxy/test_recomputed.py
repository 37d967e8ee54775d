"""A transfer whose KV never reached decode (decode's connector reports ``kv_load: "failed"``
and decode computed the prompt itself) is ``recomputed``, not ``ok``, where the proxy can see
it: in a non-streamed answer."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from app.proxy.bodies import kv_load_of
from tests.proxy.conftest import Cluster, sample


@pytest.mark.parametrize("flow", ["decode_first", "concurrent"])
def test_a_failed_kv_load_makes_the_record_recomputed(
    make_cluster: Callable[..., Cluster], flow: str
) -> None:
    c = make_cluster().start_proxy(flow=flow)
    d = c.decode[0]
    d.behaviour.kv_load = "failed"
    r = c.post(prompt="x")
    assert r.status_code == 200 and r.content == d.answers[-1]  # relayed as it came
    rec = c.record(r.headers["x-kv-transfer-id"])
    assert (rec["status"], rec["kv_load"]) == ("recomputed", "failed"), rec
    assert rec["prefill_status"] == rec["decode_status"] == 200
    d.behaviour.kv_load = "ok"
    ok = c.record(c.post(prompt="y").headers["x-kv-transfer-id"])
    assert (ok["status"], ok["kv_load"]) == ("ok", "ok")
    s = c.metrics()
    assert sample(s, "kvproxy_transfers_total", outcome="recomputed") == 1
    assert sample(s, "kvproxy_transfers_total", outcome="ok") == 1


def test_a_streamed_answer_is_not_read_for_it(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster().start_proxy()
    c.decode[0].behaviour.kv_load = "failed"  # in the last event, which the proxy only relays
    r = c.post(prompt="x", stream=True)
    assert r.status_code == 200 and '"kv_load": "failed"' in r.text
    rec = c.record(r.headers["x-kv-transfer-id"])
    assert (rec["status"], rec["kv_load"]) == ("ok", None)


def test_a_decode_failure_or_a_prefill_failure_keeps_its_own_status(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster().start_proxy()
    d, p = c.decode[0], c.prefill[0]
    d.behaviour.kv_load = "failed"
    p.behaviour.status = 500  # the cause is prefill's, and the record says so
    assert c.record(c.post(prompt="x").headers["x-kv-transfer-id"])["status"] == "prefill_failed"


def test_kv_load_is_read_leniently() -> None:
    def answer(params: object) -> bytes:
        return json.dumps({"choices": [], "kv_transfer_params": params}).encode()

    assert kv_load_of(answer({"kv_load": "failed"})) == "failed"
    assert kv_load_of(answer({"kv_load": "ok", "echo": "t"})) == "ok"
    for content in (
        answer({"kv_load": "maybe"}),
        answer({"kv_load": 1}),
        answer(None),
        answer(["kv_load"]),
        b'{"kv_load": "failed"}',  # not inside kv_transfer_params
        b'not json "kv_load": "failed"',
        b'\xff"kv_load"',
        b"[" * 100_000 + b'"kv_load"',
        b'["kv_load"]',
        b"",
    ):
        assert kv_load_of(content) is None, content[:40]
