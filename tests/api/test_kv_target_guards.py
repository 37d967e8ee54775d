"""Prefill's ``POST /v1/kv_targets`` against a stranger on the network: a real P/D pair (sim
engines, real sidecars and Mooncake), sends held for a target, and posts over real HTTP.

Each test is one thing an attacker was seen doing (issue 25): a target the sidecar cannot
use is a 400 that leaves the send waiting for decode's real one; two targets racing leave
exactly one taken; a post for a send that ended gets 409; a target that cannot be reached ends
the send FAILED with the reason; too many held sends are refused at admission; and the held
ones show in /metrics.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest

from app.sim.cluster import Cluster, ClusterSpec
from app.sim.commands import Command, SimRequest
from tests.api.conftest import AUTH, TOKEN, wait_ready
from tests.conftest import wait_for

pytestmark = pytest.mark.timeout(300)

MAX_HELD = 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    spec = ClusterSpec(
        model="llama-3.1-8b",
        layers=2,
        prefill_tp=1,
        decode_tp=1,
        max_requests=16,
        max_prompt=256,
        log_dir=str(tmp_path_factory.mktemp("target-guards")),
        sidecar_env={
            "KVSIDECAR_ADMIN_TOKEN": TOKEN,
            "KVSIDECAR_MAX_HELD_SENDS": str(MAX_HELD),
            "KVSIDECAR_HANDSHAKE_TIMEOUT_S": "2",
        },
    )
    with Cluster(spec) as c:
        for side in c.sides.values():
            wait_ready(side.admin_url)
        yield c


def hold(pair: Cluster, prefix: str, n: int = 1) -> list[SimRequest]:
    """``n`` sends admitted at prefill without a target; decode's real targets in ``remote``."""
    pairs = pair.make_requests([200] * n, prefix)
    pair.release(pairs)  # blocks of the driver's allocators; nothing here writes to them
    sends = [p for p, _ in pairs]
    out = pair.call(pair.sides["prefill"], Command(cmd="hold", requests=sends), 30)
    assert out["refused"] == [{}], out
    return sends


def target_of(req: SimRequest, **changes: Any) -> dict[str, Any]:
    assert req.remote is not None
    return {**msgspec.to_builtins(req.remote), **changes}


def post(pair: Cluster, tid: str, target: dict[str, Any]) -> httpx.Response:
    url = f"{pair.sides['prefill'].admin_url}/v1/kv_targets"
    return httpx.post(url, json={"transfer_id": tid, "target": target}, headers=AUTH, timeout=10)


def entry(pair: Cluster, rid: str) -> dict[str, Any]:
    url = f"{pair.sides['prefill'].admin_url}/v1/requests/{rid}"
    (found,) = httpx.get(url, timeout=10).json()["entries"]
    return dict(found)


def abort(pair: Cluster, sends: list[SimRequest]) -> None:
    """End what a test held, so the next one starts with nothing held."""
    url = pair.sides["prefill"].admin_url
    for req in sends:
        httpx.post(f"{url}/v1/requests/{req.id}/abort", headers=AUTH, timeout=10)
    pair.call(pair.sides["prefill"], Command(cmd="reports"), 30)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"host": "bad host"}, "host"),
        ({"host": "tcp://10.0.0.1"}, "host"),
        ({"port": 0}, "port"),
        ({"port": 70000}, "port"),
        ({"engine_id": "e" * 10_000}, "engine_id"),
        ({"block_ids": []}, "KV cache groups"),
        ({"block_ids": [list(range(1000))]}, "at most"),
    ],
)
def test_unusable_target_is_400_and_the_send_still_waits(
    pair: Cluster, change: dict[str, Any], said: str
) -> None:
    (req,) = hold(pair, f"bad-{next(iter(change))}-{len(str(change))}")
    try:
        r = post(pair, req.id, target_of(req, **change))
        assert r.status_code == 400, r.text
        assert said in r.json()["detail"]
        # Nothing was connected to and nothing taken: decode's real target still gets in.
        assert entry(pair, req.id)["state"] == "PENDING"
        ok = post(pair, req.id, target_of(req))
        assert ok.status_code == 200, ok.text
    finally:
        abort(pair, [req])


def test_of_two_racing_targets_exactly_one_is_taken(pair: Cluster) -> None:
    sends = hold(pair, "race", MAX_HELD)

    async def race(req: SimRequest) -> list[int]:
        url = f"{pair.sides['prefill'].admin_url}/v1/kv_targets"
        body = {"transfer_id": req.id, "target": target_of(req)}
        async with httpx.AsyncClient(headers=AUTH, timeout=10) as client:
            got = await asyncio.gather(*(client.post(url, json=body) for _ in range(2)))
        return sorted(r.status_code for r in got)

    async def all_races() -> list[list[int]]:
        return [await race(req) for req in sends]

    try:
        assert asyncio.run(all_races()) == [[200, 409]] * len(sends)
    finally:
        abort(pair, sends)


def test_post_for_a_send_that_ended_and_was_reported_is_409(pair: Cluster) -> None:
    (req,) = hold(pair, "ended")
    abort(pair, [req])  # aborted, and the engine heard of it
    assert entry(pair, req.id)["state"] == "ABORTED"
    r = post(pair, req.id, target_of(req))
    assert r.status_code == 409, r.text
    assert "already ended" in r.json()["detail"]


def test_target_that_cannot_be_reached_ends_the_send_failed(pair: Cluster) -> None:
    (req,) = hold(pair, "unreachable")
    # Well formed, but nobody answers there: the handshake times out (2 s here).
    r = post(pair, req.id, target_of(req, host="127.0.0.1", port=9))
    assert r.status_code == 200, r.text
    found = wait_for(
        "the send to end", lambda: (e := entry(pair, req.id))["state"] != "PENDING" and e, 20
    )
    assert found["state"] == "FAILED" and "tcp://127.0.0.1:9" in found["error"], found
    pair.call(pair.sides["prefill"], Command(cmd="reports"), 30)


def test_held_sends_are_capped_and_shown_in_metrics(pair: Cluster) -> None:
    sends = hold(pair, "cap", MAX_HELD)
    try:
        metrics = httpx.get(f"{pair.sides['prefill'].admin_url}/metrics", timeout=10).text
        assert f'kvsidecar_held_sends{{rank="0"}} {MAX_HELD}.0' in metrics
        blocks = sum(len(ids) for ids in sends[0].blocks) * MAX_HELD
        assert f'kvsidecar_held_blocks{{rank="0"}} {blocks}.0' in metrics
        [age] = [ln for ln in metrics.splitlines() if ln.startswith("kvsidecar_held_oldest_age")]
        assert float(age.rsplit(" ", 1)[1]) > 0
        extra_pairs = pair.make_requests([200], "cap-over")
        pair.release(extra_pairs)
        extra = [p for p, _ in extra_pairs]
        out = pair.call(pair.sides["prefill"], Command(cmd="hold", requests=extra), 30)
        (refused,) = out["refused"]
        assert "max_held_sends=4" in refused[extra[0].id], out
    finally:
        abort(pair, sends)
    metrics = httpx.get(f"{pair.sides['prefill'].admin_url}/metrics", timeout=10).text
    assert 'kvsidecar_held_sends{rank="0"} 0.0' in metrics
