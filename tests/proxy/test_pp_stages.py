"""Pipeline parallel at the rendezvous: each of decode's stages posts a target of its own, and
a transfer has its targets only once every stage posted; prefill's stage k gets stage k's.

Decode's fake does not post here: the test posts each stage's target with the transfer's
token, as decode's workers of two stages would, and holds decode's answer until it is done.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx

from app.proxy.bodies import TRANSFER_TOKEN_HEADER, TRANSFER_TOKEN_PARAM
from tests.proxy.conftest import Cluster, wait_for


def stage_target(stage: int) -> dict[str, Any]:
    return {
        "request_id": "t",
        "host": "127.0.0.1",
        "port": 4000 + stage,
        "engine_id": f"d_pp{stage}",
    }


@contextmanager
def held_request(c: Cluster) -> Iterator[tuple[str, dict[str, str], Future[httpx.Response]]]:
    """A client request whose decode neither posts nor answers until the block ends: its
    transfer id and token header, and the client's answer."""
    d = c.decode[0]
    d.behaviour.post_target, d.behaviour.hold = False, threading.Event()
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(c.post, prompt="x")
        seen = wait_for("decode's request", lambda: d.requests and d.requests[0])
        kv = seen.body["kv_transfer_params"]
        try:
            yield kv["transfer_id"], {TRANSFER_TOKEN_HEADER: kv[TRANSFER_TOKEN_PARAM]}, answer
        finally:
            d.behaviour.hold.set()
            assert answer.result().status_code == 200


def post(c: Cluster, tid: str, headers: dict[str, str], **stage: Any) -> httpx.Response:
    which = stage.get("pp_stage", 0)
    target = stage_target(which if isinstance(which, int) else 0)
    body = {"transfer_id": tid, "target": target, **stage}
    return c.client.post(f"{c.url}/v1/kv_targets", json=body, headers=headers)


def test_decode_first_waits_for_every_stage_and_hands_prefill_each(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster().start_proxy()  # decode first
    p = c.prefill[0]
    with held_request(c) as (tid, headers, _):
        assert post(c, tid, headers, pp_stage=1, pp_size=2).status_code == 200
        # One stage of two: prefill is not asked yet.
        assert not c.shared.seen(tid).wait(0.5) and not p.requests
        assert post(c, tid, headers, pp_stage=0, pp_size=2).status_code == 200
        kv = wait_for("prefill's request", lambda: p.requests and p.requests[0]).body[
            "kv_transfer_params"
        ]
    assert kv["remote"] == stage_target(0)
    assert kv["remote_stages"] == [stage_target(0), stage_target(1)]


def test_concurrent_prefill_stages_each_fetch_their_own(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster().start_proxy(flow="concurrent")
    p = c.prefill[0]
    with held_request(c) as (tid, headers, _):
        for stage in (0, 1):
            assert post(c, tid, headers, pp_stage=stage, pp_size=2).status_code == 200
        url = f"{c.url}/v1/kv_targets/{tid}"
        for stage in (0, 1):
            r = c.client.get(url, params={"pp_stage": stage, "pp_size": 2}, headers=headers)
            assert r.status_code == 200, r.text
            assert r.json()["target"] == stage_target(stage)
        # The prefill fake fetched as a one-stage engine: refused, saying why.
        status, body = wait_for("prefill's fetch", lambda: p.fetched.get(tid))
    assert status == 409
    assert "decode runs 2 pipeline stage(s) and prefill 1" in body["error"]["message"]
    assert "same pipeline_parallel_size" in body["error"]["message"]


def test_stage_posts_that_do_not_fit_are_refused(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster().start_proxy()
    with held_request(c) as (tid, headers, _):
        bad = post(c, tid, headers, pp_stage=2, pp_size=2)
        assert bad.status_code == 400 and "pp_stage 2 of pp_size 2" in bad.text
        assert post(c, tid, headers, pp_stage="1", pp_size=2).status_code == 400
        assert post(c, tid, headers, pp_stage=0, pp_size=3).status_code == 200
        again = post(c, tid, headers, pp_stage=0, pp_size=3)
        assert again.status_code == 409 and "stage 0 already has a target" in again.text
        other = post(c, tid, headers, pp_stage=1, pp_size=2)
        assert other.status_code == 409 and "pp_size 2, where an earlier stage said 3" in other.text
        # Strangers are refused before any of that is looked at.
        assert post(c, tid, {}, pp_stage=1, pp_size=3).status_code == 401
