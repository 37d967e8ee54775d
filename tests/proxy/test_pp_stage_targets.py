"""A prefill that runs more pipeline stages than decode gets no target at the rendezvous: each
of its stages' fetches is refused (409) saying both counts, because decode's stage k takes the
layers of prefill's stage k and no decode stage would take the others. The reverse (decode with
more stages) is test_pp_stages.py's."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from app.proxy.bodies import TRANSFER_TOKEN_HEADER, TRANSFER_TOKEN_PARAM
from tests.proxy.conftest import Cluster, wait_for


def test_prefill_with_more_stages_than_decode_is_refused_at_every_stage(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster().start_proxy(flow="concurrent")
    d, p = c.decode[0], c.prefill[0]
    d.behaviour.hold = threading.Event()  # decode posts its one target, then holds its answer
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(c.post, prompt="x")
        try:
            kv = wait_for("decode's request", lambda: d.requests and d.requests[0]).body[
                "kv_transfer_params"
            ]
            tid, headers = kv["transfer_id"], {TRANSFER_TOKEN_HEADER: kv[TRANSFER_TOKEN_PARAM]}
            wait_for("decode's target", lambda: d.posts)
            for stage in (0, 1):
                r = c.client.get(
                    f"{c.url}/v1/kv_targets/{tid}",
                    params={"pp_stage": stage, "pp_size": 2, "timeout_s": 2},
                    headers=headers,
                )
                assert r.status_code == 409, r.text
                message = r.json()["error"]["message"]
                assert "decode runs 1 pipeline stage(s) and prefill 2" in message, message
                assert "same pipeline_parallel_size" in message
            # The prefill fake fetched as one stage, as decode runs: that one is handed over.
            status, _ = wait_for("prefill's fetch", lambda: p.fetched.get(tid))
            assert status == 200
        finally:
            d.behaviour.hold.set()
        assert answer.result().status_code == 200
