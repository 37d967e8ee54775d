"""The concurrent flow (the default): the prompt goes to prefill and decode at once; prefill's
connector fetches decode's target from the proxy by transfer id; when decode's request ends the
id closes, and a prefill still waiting hears why."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tests.proxy.conftest import Cluster, wait_for


def concurrent(make_cluster: Callable[..., Cluster], **kw: int) -> Cluster:
    return make_cluster(**kw).start_proxy(flow="concurrent")


def test_prefill_starts_before_the_target_and_fetches_it(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = concurrent(make_cluster)
    d, p = c.decode[0], c.prefill[0]
    d.behaviour.post_delay_s = 0.3  # decode allocates slowly
    r = c.post(prompt="x")
    assert r.status_code == 200 and r.content == d.answers[-1]
    tid = r.headers["x-kv-transfer-id"]
    [seen] = p.requests
    kv = seen.body["kv_transfer_params"]
    assert kv["do_remote_decode"] and "remote" not in kv
    assert kv["router_url"].endswith("/v1/kv_targets") and kv["transfer_id"] == tid
    assert seen.at < d.posted_at[tid]  # prefill had the prompt before decode's target existed
    status, body = wait_for("prefill's fetch", lambda: p.fetched.get(tid))
    ((posted, _, _),) = d.posts
    assert status == 200 and body["target"] == posted["target"]
    rec = c.record(tid)
    assert rec["status"] == "ok" and rec["target_ms"] >= 300


def test_decode_ending_without_target_tells_the_waiting_prefill(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = concurrent(make_cluster)
    d, p = c.decode[0], c.prefill[0]
    d.behaviour.post_target = False  # e.g. decode held the whole prompt in its cache
    r = c.post(prompt="x")
    assert r.status_code == 200
    tid = r.headers["x-kv-transfer-id"]
    status, body = wait_for("prefill's fetch", lambda: p.fetched.get(tid))
    assert status == 409
    assert "no longer waiting: decode's request ended (ok)" in body["error"]["message"]
    assert c.record(tid)["status"] == "no_target"


def test_failed_decode_tells_the_waiting_prefill(make_cluster: Callable[..., Cluster]) -> None:
    c = concurrent(make_cluster)
    d, p = c.decode[0], c.prefill[0]
    d.behaviour.post_target, d.behaviour.status = False, 500
    r = c.post(prompt="x")
    tid = r.headers["x-kv-transfer-id"]
    status, body = wait_for("prefill's fetch", lambda: p.fetched.get(tid))
    assert status == 409 and "decode's request ended (failed)" in body["error"]["message"]
    assert c.record(tid)["status"] == "decode_failed"


def test_fetch_of_an_unknown_transfer_is_401_and_a_slow_one_504(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = concurrent(make_cluster)
    r = c.get("/v1/kv_targets/nope?timeout_s=0.1")  # as a live id without its token
    assert r.status_code == 401 and "needs its token" in r.json()["error"]["message"]
    d = c.decode[0]
    d.behaviour.post_delay_s = 1.0
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(c.post, prompt="x")
        seen = wait_for("decode's request", lambda: d.requests and d.requests[0])
        kv = seen.body["kv_transfer_params"]
        slow = c.get(
            f"/v1/kv_targets/{kv['transfer_id']}?timeout_s=0.1",
            headers={"x-kv-transfer-token": kv["transfer_token"]},
        )
        assert slow.status_code == 504 and "within 0.1 s" in slow.json()["error"]["message"]
        assert answer.result().status_code == 200


def test_concurrent_requests_each_prefill_fetches_its_own_target(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster(n_prefill=2, n_decode=2).start_proxy(
        flow="concurrent", policy="least_outstanding"
    )
    for d in c.decode:
        d.behaviour.chunks, d.behaviour.chunk_delay_s = 3, 0.02
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda i: c.post(prompt=f"p{i}", stream=i % 2 == 0), range(32)))
    assert [a.status_code for a in answers] == [200] * 32
    tids = {a.headers["x-kv-transfer-id"] for a in answers}
    posted = {body["transfer_id"]: body["target"] for d in c.decode for body, _, _ in d.posts}

    def fetched() -> dict[str, object] | None:
        got = {tid: body for p in c.prefill for tid, (_, body) in p.fetched.items()}
        return got if len(got) == 32 else None

    got = wait_for("every prefill's fetch", fetched)
    assert set(posted) == set(got) == tids
    assert all(got[tid]["target"] == posted[tid] for tid in tids)  # type: ignore[index]
    assert all(c.record(tid)["status"] == "ok" for tid in tids)


def test_a_fetch_waits_the_proxys_target_timeout_by_default(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster().start_proxy(flow="concurrent", target_timeout_s=0.3)
    d = c.decode[0]
    d.behaviour.post_delay_s = 1.0
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(c.post, prompt="x")
        seen = wait_for("decode's request", lambda: d.requests and d.requests[0])
        kv = seen.body["kv_transfer_params"]
        slow = c.get(
            f"/v1/kv_targets/{kv['transfer_id']}",
            headers={"x-kv-transfer-token": kv["transfer_token"]},
        )
        assert slow.status_code == 504 and "within 0.3 s" in slow.json()["error"]["message"]
        assert answer.result().status_code == 200
