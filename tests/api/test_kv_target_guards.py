"""Prefill's ``POST /v1/kv_targets`` against a stranger on the network: a real P/D pair (sim
engines, real sidecars and Mooncake), sends held for a target, and posts over real HTTP.

Each test is one thing an attacker was seen doing (issues 25, 38): a target the sidecar
cannot use is a 400, and one decode's sidecar did not sign (or signed for another transfer) a
401 with nothing connected to, both leaving the send waiting for decode's real one; two
targets racing leave exactly one taken; a post for a send that ended gets 409; a target that
cannot be reached ends the send FAILED with the reason; too many held sends are refused at
admission; and the held ones show in /metrics.
"""

from __future__ import annotations

import asyncio
import hmac
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest

from app.engine_link.client import EngineLink, EngineLinkError
from app.errors import ProtocolError
from app.sim.cluster import Cluster, ClusterSpec
from app.sim.commands import Command, SimRequest
from app.sim.side import target_signer
from app.transfer.wire.protocol import RemoteTarget
from app.transfer.wire.target_auth import TargetSigner, prompt_digest, remote_target
from tests.api.conftest import AUTH, TOKEN, wait_ready
from tests.conftest import wait_for

pytestmark = pytest.mark.timeout(300)

MAX_HELD = 4
SIGNER = target_signer({})  # the sidecars here run on this user's generated key


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
    """Decode's real target, or one with ``changes`` signed anew with the pair's key: what a
    key holder could post, so that the checks after the signature's are what is tested. A
    change the schema refuses stays unsigned (it is refused before the signature is read)."""
    assert req.remote is not None
    if not changes:
        return dict(msgspec.to_builtins(req.remote))
    changed = {**msgspec.to_builtins(req.remote), **changes, "signature": ""}
    try:
        signed = SIGNER.sign(remote_target(changed))
    except ProtocolError:
        return changed
    return dict(msgspec.to_builtins(signed))


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


def _listener() -> socket.socket:
    """A TCP port on loopback that counts who connects (the target a stranger names)."""
    sock = socket.create_server(("127.0.0.1", 0))
    sock.setblocking(False)
    return sock


def _connections(sock: socket.socket) -> int:
    n = 0
    while True:
        try:
            conn, _ = sock.accept()
        except BlockingIOError:
            return n
        conn.close()
        n += 1


@pytest.mark.parametrize("forgery", ["unsigned", "other key", "changed after signing"])
def test_target_not_signed_by_decode_is_401_and_nothing_is_connected_to(
    pair: Cluster, forgery: str
) -> None:
    (req,) = hold(pair, f"forged-{forgery.replace(' ', '-')}")
    lure = _listener()
    try:
        port = lure.getsockname()[1]
        real = target_of(req)
        if forgery == "unsigned":
            forged = {**real, "host": "127.0.0.1", "port": port, "signature": ""}
        elif forgery == "other key":
            other = TargetSigner(b"o" * 32)
            unsigned = remote_target({**real, "port": port, "signature": ""})
            forged = dict(msgspec.to_builtins(other.sign(unsigned)))
        else:
            forged = {**real, "port": port}  # decode's signature, another port
        r = post(pair, req.id, forged)
        assert r.status_code == 401, r.text
        assert "sign" in r.json()["detail"]
        time.sleep(0.5)  # a connect would have been started by now
        assert _connections(lure) == 0
        # The send still waits, and decode's real target still gets in.
        assert entry(pair, req.id)["state"] == "PENDING"
        ok = post(pair, req.id, real)
        assert ok.status_code == 200, ok.text
    finally:
        lure.close()
        abort(pair, [req])


def test_signed_target_of_another_transfer_is_401_and_neither_send_is_touched(
    pair: Cluster,
) -> None:
    """Decode's real signed target for X, posted for Y (issue 38): a good signature vouches
    for X's blocks only. Taken, it would end Y at decode's claim, and Y's own target would get
    409."""
    x, y = hold(pair, "bound", 2)
    try:
        r = post(pair, y.id, target_of(x))
        assert r.status_code == 401, r.text
        detail = r.json()["detail"]
        assert f"signed for transfer {x.id!r} was posted for {y.id!r}" in detail, detail
        assert [entry(pair, s.id)["state"] for s in (x, y)] == ["PENDING", "PENDING"]
        for own in (y, x):  # each still takes its own
            ok = post(pair, own.id, target_of(own))
            assert ok.status_code == 200, ok.text
    finally:
        abort(pair, [x, y])


def test_target_signed_for_another_prompt_is_401_counted_and_the_send_still_waits(
    pair: Cluster,
) -> None:
    """Decode's signed target for X's transfer but another prompt (issue 50, item 9: what a
    stranger replaying a captured target with another prompt holds): refused by each rank's
    send before anything is connected to, counted in /metrics, and X still takes its own."""
    (x,) = hold(pair, "prompt")
    metrics = f"{pair.sides['prefill'].admin_url}/metrics"
    before = _counter(httpx.get(metrics, timeout=10).text, "kvsidecar_refused_targets_total")
    try:
        r = post(pair, x.id, target_of(x, prompt_digest=prompt_digest([7] * 200)))
        assert r.status_code == 401, r.text
        assert "signed for another prompt" in r.json()["detail"], r.text
        assert entry(pair, x.id)["state"] == "PENDING"
        after = _counter(httpx.get(metrics, timeout=10).text, "kvsidecar_refused_targets_total")
        assert after == before + 1
        ok = post(pair, x.id, target_of(x))
        assert ok.status_code == 200, ok.text
    finally:
        abort(pair, [x])


def test_target_of_the_format_before_prompt_digests_is_401_by_name(pair: Cluster) -> None:
    """A target as a decode sidecar of the previous release posts it: no ``format`` and no
    ``prompt_digest``, signed as that release signed. Refused naming the format."""
    (x,) = hold(pair, "format-1")
    old = {k: v for k, v in target_of(x).items() if k not in ("format", "prompt_digest")}
    unsigned = msgspec.msgpack.encode({**old, "signature": ""})
    old["signature"] = hmac.new(SIGNER.key, b"kv-sidecar target v1\x00" + unsigned, "sha256")
    old["signature"] = old["signature"].hexdigest()
    try:
        r = post(pair, x.id, old)
        assert r.status_code == 401, r.text
        assert "of format 1: expected format 2" in r.json()["detail"], r.text
        assert entry(pair, x.id)["state"] == "PENDING"
    finally:
        abort(pair, [x])


def _counter(text: str, name: str) -> float:
    (line,) = [ln for ln in text.splitlines() if ln.startswith(name + " ")]
    return float(line.split()[1])


def test_engine_link_takes_no_target_of_another_transfer(pair: Cluster) -> None:
    """The same target through prefill's engine link (``SetTarget``, as the connector hands
    over what it fetched): refused naming both ids; the engine gives no other, so Y ends
    FAILED at once, and X, whose target it was, still waits for it and takes it."""
    x, y = hold(pair, "bound-link", 2)
    p = pair.sides["prefill"]
    link = EngineLink(p.ipc, p.engine_id, 0, timeout_s=10)
    try:
        assert x.remote is not None
        with pytest.raises(EngineLinkError, match=f"signed for transfer {x.id!r} was posted"):
            link.set_target(y.id, x.remote)
        assert [entry(pair, s.id)["state"] for s in (x, y)] == ["PENDING", "FAILED"]
        ok = post(pair, x.id, target_of(x))
        assert ok.status_code == 200, ok.text
    finally:
        link.close(unlink=False)
        abort(pair, [x, y])


def test_signed_target_needs_no_admin_token_but_an_error_post_does(pair: Cluster) -> None:
    """Decode's connector holds no admin token: its signed target gets in without one (the
    prefill-first flow with the token set); an error, which ends the send, does not."""
    url = f"{pair.sides['prefill'].admin_url}/v1/kv_targets"
    (req,) = hold(pair, "no-token")
    try:
        err = httpx.post(url, json={"transfer_id": req.id, "error": "stranger"}, timeout=10)
        assert err.status_code == 401, err.text
        assert entry(pair, req.id)["state"] == "PENDING"
        ok = httpx.post(url, json={"transfer_id": req.id, "target": target_of(req)}, timeout=10)
        assert ok.status_code == 200, ok.text
    finally:
        abort(pair, [req])


def test_decode_sidecar_signs_only_targets_naming_itself(pair: Cluster) -> None:
    """What decode's connector gets signed must point prefill at decode's own sidecar as it runs
    now: a signature is never lent to another host, port, engine or an old epoch."""
    d = pair.sides["decode"]
    link = EngineLink(d.ipc, d.engine_id, 0, timeout_s=10)
    try:
        info = link.sidecar_info()
        own = RemoteTarget(
            "sign-me", str(info["host"]), int(info["port"] or 0), d.engine_id,
            str(info["epoch"]), d.tp, [[1, 2]],
        )  # fmt: skip
        (signed,) = link.sign_targets([own])
        SIGNER.verify(signed)  # the key prefill checks with
        for change in ({"port": 9}, {"host": "10.0.0.9"}, {"engine_id": "x"}, {"epoch": "old"}):
            with pytest.raises(EngineLinkError, match="not signed"):
                link.sign_targets([msgspec.structs.replace(own, **change)])
    finally:
        link.close(unlink=False)
