"""Per-transfer tokens: only the engines a transfer's token was given to may post or fetch its
target; strangers get 401 and change nothing, and the token never leaves through the client's
answer or the records."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from app.proxy.bodies import TRANSFER_TOKEN_HEADER, TRANSFER_TOKEN_PARAM
from app.proxy.targets import TargetRendezvous
from tests.proxy.conftest import Cluster, FakeVLLM, wait_for

WRONG = {TRANSFER_TOKEN_HEADER: "not-the-token"}


def _first_params(engine: FakeVLLM) -> dict[str, Any]:
    seen = wait_for(f"{engine.name}'s request", lambda: engine.requests and engine.requests[0])
    params: dict[str, Any] = seen.body["kv_transfer_params"]
    return params


def test_strangers_posting_targets_or_errors_get_401_and_change_nothing(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster().start_proxy()  # decode first: the proxy itself waits for the target
    d, p = c.decode[0], c.prefill[0]
    d.behaviour.post_delay_s = 0.5  # strangers get in before decode's own post
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(c.post, prompt="x")
        kv = _first_params(d)
        tid, token = kv["transfer_id"], kv[TRANSFER_TOKEN_PARAM]
        for headers in ({}, WRONG):
            for payload in (
                {"transfer_id": tid, "target": {"host": "evil", "port": 1}},
                {"transfer_id": tid, "error": "stranger says abort"},
            ):
                r = c.client.post(f"{c.url}/v1/kv_targets", json=payload, headers=headers)
                assert r.status_code == 401, (headers, payload, r.text)
                assert r.json()["error"]["type"] == "authentication_error"
                assert TRANSFER_TOKEN_HEADER in r.json()["error"]["message"]
                assert token not in r.text and tid not in r.text
        assert answer.result().status_code == 200
    # Decode's own post was the one taken: prefill pushed to its target, nothing aborted.
    ((posted, status, _),) = d.posts
    assert status == 200
    assert p.requests[0].body["kv_transfer_params"]["remote"] == posted["target"]
    assert c.record(tid)["status"] == "ok"


def test_strangers_fetching_a_target_get_401_before_anything_about_the_id(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster().start_proxy(flow="concurrent")
    d, p = c.decode[0], c.prefill[0]
    d.behaviour.post_delay_s = 0.5
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(c.post, prompt="x")
        kv = _first_params(d)
        tid, token = kv["transfer_id"], kv[TRANSFER_TOKEN_PARAM]
        for headers in ({}, WRONG):
            # A long wait asked for: refused at once, not after decode's target came.
            r = c.get(f"/v1/kv_targets/{tid}?timeout_s=3", headers=headers)
            assert r.status_code == 401, (headers, r.text)
            assert token not in r.text and tid not in r.text
        assert answer.result().status_code == 200
    status, body = wait_for("prefill's own fetch", lambda: p.fetched.get(tid))
    ((posted, _, _),) = d.posts
    assert status == 200 and body["target"] == posted["target"]
    assert c.record(tid)["status"] == "ok"
    # Ended: why it stopped waiting is still told only to the token's holder.
    assert c.get(f"/v1/kv_targets/{tid}?timeout_s=0.1").status_code == 401
    late = c.get(f"/v1/kv_targets/{tid}?timeout_s=0.1", headers={TRANSFER_TOKEN_HEADER: token})
    assert late.status_code == 409 and "no longer waiting" in late.text
    # An id the proxy never issued answers alike: which ids are live is nobody else's business.
    assert c.get("/v1/kv_targets/nope?timeout_s=0.1").status_code == 401


@pytest.mark.parametrize("flow", ["decode_first", "concurrent"])
def test_token_reaches_both_engines_and_nobody_else(
    make_cluster: Callable[..., Cluster], flow: str
) -> None:
    c = make_cluster().start_proxy(flow=flow)
    answers = [c.post(prompt="x"), c.post(prompt="y", stream=True)]
    tokens = [r.body["kv_transfer_params"][TRANSFER_TOKEN_PARAM] for r in c.decode[0].requests]
    assert [r.body["kv_transfer_params"][TRANSFER_TOKEN_PARAM] for r in c.prefill[0].requests] == (
        tokens
    )
    assert len(set(tokens)) == 2 and all(len(t) >= 43 for t in tokens)  # one per transfer
    for r in answers:
        assert r.status_code == 200
        c.record(r.headers["x-kv-transfer-id"])  # settled
        shown = [r.text, *r.headers.values()]
        shown += [c.get("/v1/transfers").text, c.get("/health").text]
        shown.append(c.get(f"/v1/transfers/{r.headers['x-kv-transfer-id']}").text)
        assert not [t for t in tokens for s in shown if t in s]


def test_a_request_served_by_decode_alone_carries_no_token(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster().start_proxy(min_prefill_tokens=10_000)
    assert c.post(prompt="short").status_code == 200
    assert "kv_transfer_params" not in c.decode[0].requests[0].body
    assert c.prefill[0].requests == []


async def test_a_forgotten_transfer_forgets_its_token() -> None:
    r = TargetRendezvous(remember=1)
    r.open("a", "token-a")
    assert r.deliver("a", "token-b", {"x": 1}).status == 401
    assert r.fail("a", None, "abort").status == 401
    assert r.deliver("a", "token-a", {"x": 1}).status == 200
    r.close("a", "done")
    assert r.deliver("a", "wrong", {"x": 1}).status == 401  # closed, still remembered
    assert r.deliver("a", "token-a", {"x": 1}).status == 409
    r.open("b", "token-b")
    r.close("b", "done")  # pushes "a" out of the memory of 1
    assert r.deliver("a", "token-a", {"x": 1}).status == 401  # forgotten: as any unknown id
    assert r.refusal("a", "token-a") is not None
