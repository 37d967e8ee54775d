"""What a stranger gets from the proxy's ``/v1/kv_targets`` (issue 38): an id the proxy never
issued is refused exactly as a live one without its token (same status, same body), so posts
and fetches cannot tell which ids are live; and refused posts are logged throttled, one line per
status per interval saying how many were held back, so nobody can flood the proxy's log."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from app.proxy import targets
from app.proxy.bodies import TRANSFER_TOKEN_HEADER
from tests.proxy.conftest import Cluster, wait_for

WRONG = {TRANSFER_TOKEN_HEADER: "not-the-token"}


def _post(c: Cluster, tid: str, headers: dict[str, str]) -> httpx.Response:
    body = {"transfer_id": tid, "target": {"host": "evil", "port": 1}}
    return c.client.post(f"{c.url}/v1/kv_targets", json=body, headers=headers)


def _fetch(c: Cluster, tid: str, headers: dict[str, str]) -> httpx.Response:
    return c.get(f"/v1/kv_targets/{tid}?timeout_s=0.1", headers=headers)


def test_unknown_and_live_ids_are_refused_alike(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster().start_proxy()  # decode first: the id stays live while decode holds
    d = c.decode[0]
    d.behaviour.post_target, d.behaviour.hold = False, threading.Event()
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(c.post, prompt="x")
        seen = wait_for("decode's request", lambda: d.requests and d.requests[0])
        live = seen.body["kv_transfer_params"]["transfer_id"]
        made_up = "x" * len(live)
        try:
            for call in (_post, _fetch):
                for headers in ({}, WRONG):
                    got = [call(c, tid, headers) for tid in (live, made_up)]
                    assert [r.status_code for r in got] == [401, 401], [r.text for r in got]
                    assert got[0].json() == got[1].json(), (call.__name__, headers)
        finally:
            d.behaviour.hold.set()
        assert answer.result().status_code == 200


def test_refused_posts_are_logged_throttled_with_the_count_held_back(
    make_cluster: Callable[..., Cluster],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    interval = 1.0
    monkeypatch.setattr(targets, "REFUSED_LOG_INTERVAL_S", interval)
    c = make_cluster().start_proxy()
    caplog.set_level(logging.WARNING, logger=targets.__name__)

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == targets.__name__]

    t0 = time.monotonic()
    for i in range(20):
        assert _post(c, f"stranger-{i}", WRONG).status_code == 401
    assert time.monotonic() - t0 < interval, "too slow to test the interval here"
    assert len(lines()) == 1 and lines()[0].startswith("target post refused (401)")
    time.sleep(interval)
    assert _post(c, "stranger-last", WRONG).status_code == 401
    assert len(lines()) == 2 and "(19 more 401s since the last line)" in lines()[1], lines()
