"""Faults end every request in exactly one terminal state, within its deadline."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import httpx
import msgspec
import zmq

from app.config import load_settings
from app.sim.cluster import Cluster
from app.sim.commands import Command
from app.sim.rounds import summarize
from app.store.master import free_port
from app.transfer.wire.auth import load_auth
from app.transfer.wire.codec import decode, encode
from app.transfer.wire.protocol import Ack, Done, Error, Hello, Rejected, Role, Status
from tests.e2e import fault_sidecar
from tests.e2e.conftest import request_entry

FAST = {"KVSIDECAR_ACK_TIMEOUT_S": "2", "KVSIDECAR_HANDSHAKE_TIMEOUT_S": "3"}


def _statuses(rank_results: list[dict[str, object]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for r in rank_results:
        for rid in r["done"]:  # type: ignore[attr-defined]
            out[rid] = "DONE"
        for rid, f in r["failed"].items():  # type: ignore[attr-defined]
            out.setdefault(rid, f["status"])
    return out


def test_decode_killed_mid_transfer_fails_prefill_and_unpins(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster(
        prefill_tp=2, decode_tp=1, layers=8, max_requests=3, max_prompt=1024, sidecar_env=FAST
    )
    p, d = c.sides["prefill"], c.sides["decode"]
    pairs = c.make_requests([1024, 1024, 900])
    c.call(
        d,
        Command(cmd="expect", requests=[dr for _, dr in pairs], timeout_s=30, prefill_tp=p.tp),
        30,
    )
    t0 = time.monotonic()
    # 8 layers x 8 chunks x 30 ms of compute: the transfer is still running when D dies.
    c.send(
        p,
        Command(
            cmd="prefill", requests=[pr for pr, _ in pairs], chunk=128, compute_ms=30, timeout_s=30
        ),
    )
    time.sleep(1.0)
    c.kill_side(d)
    out = c.recv(p, 60)
    elapsed = time.monotonic() - t0
    statuses = _statuses(out["ranks"])
    assert set(statuses) == {pr.id for pr, _ in pairs}
    assert set(statuses.values()) == {"FAILED"}, statuses
    # Reported as failed means every write reading those blocks ended: the pins are released.
    for r in out["ranks"]:
        assert all(f["blocks"] for f in r["failed"].values()), r["failed"]
    assert elapsed < 45


def test_prefill_killed_decode_expires_with_block_ids(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster(
        prefill_tp=1,
        decode_tp=2,
        layers=4,
        max_requests=2,
        max_prompt=512,
        decode_env={"KVSIDECAR_RECV_TIMEOUT_S": "3"},
    )
    p, d = c.sides["prefill"], c.sides["decode"]
    pairs = c.make_requests([512, 300])
    c.call(d, Command(cmd="expect", requests=[dr for _, dr in pairs], timeout_s=3), 30)
    c.kill_side(p)
    t0 = time.monotonic()
    out = c.call(d, Command(cmd="wait", requests=[dr for _, dr in pairs], timeout_s=3), 30)
    assert time.monotonic() - t0 < 10
    for rank in out["ranks"]:
        assert rank["done"] == []
        assert {k: v["status"] for k, v in rank["failed"].items()} == {
            "req-0": "EXPIRED",
            "req-1": "EXPIRED",
        }
        for _, dr in pairs:
            assert rank["failed"][dr.id]["blocks"] == dr.blocks


def test_decode_restart_rehandshakes_and_new_requests_succeed(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster(
        prefill_tp=2, decode_tp=2, layers=4, max_requests=4, max_prompt=256, sidecar_env=FAST
    )
    d = c.sides["decode"]
    first = c.make_requests([256], prefix="before")
    assert summarize(c.run(first), first)["verified"] == 1
    old_epoch = d.info[0]["epoch"]
    stale = c.make_requests([200], prefix="stale")  # still aimed at the old epoch
    c.kill_side(d)
    c.start_side(d, same_ports=True)  # the address the stale target names, with a new epoch
    c.wait_ready(d)
    assert d.info[0]["epoch"] != old_epoch
    fresh = c.make_requests([256, 100], prefix="after")
    s = summarize(c.run(fresh), fresh)
    assert s["verified"] == 2 and s["failures"] == {}
    # A request addressed to the old epoch fails fast at admission, never DONE.
    out = c.call(
        c.sides["prefill"], Command(cmd="prefill", requests=[stale[0][0]], timeout_s=5), 30
    )
    failed = out["ranks"][0]["failed"]
    assert failed["stale-0"]["status"] == "FAILED"
    assert "epoch" in failed["stale-0"]["error"]


def test_injected_transfer_error_fails_never_done(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster(
        prefill_tp=1,
        decode_tp=1,
        layers=4,
        max_requests=2,
        max_prompt=256,
        sidecar_cmd={"prefill": fault_sidecar.command(fail_writes=1)},
        sidecar_env=FAST,
    )
    pairs = c.make_requests([256, 256])
    result = c.run(pairs, timeout_s=15)
    s = summarize(result, pairs)
    assert s["verified"] == 0
    assert {f["status"] for f in s["failures"].values()} == {"FAILED"}
    assert "injected" in " ".join(f["error"] for f in s["failures"].values())
    # Decode heard it from prefill: FAILED there too, not DONE.
    assert _statuses(result["decode"]["ranks"]) == {"req-0": "FAILED", "req-1": "FAILED"}
    # The engine recovered: the next request goes through.
    again = c.make_requests([256], prefix="again")
    assert summarize(c.run(again), again)["verified"] == 1


def test_out_of_range_block_ids_fail_with_nothing_written(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster(
        prefill_tp=2, decode_tp=1, layers=4, max_requests=2, max_prompt=256, sidecar_env=FAST
    )
    d = c.sides["decode"]
    pairs = c.make_requests([256])
    pr, _dr = pairs[0]
    assert pr.remote is not None
    bad = d.params.num_blocks + 5
    c.retarget(pr, block_ids=[[*ids[:-1], bad] for ids in pr.remote.block_ids])
    result = c.run(pairs, timeout_s=5)
    statuses = _statuses(result["prefill"]["ranks"])
    assert statuses == {"req-0": "FAILED"}
    errors = [f["error"] for r in result["prefill"]["ranks"] for f in r["failed"].values()]
    assert any(str(bad) in e and "outside" in e for e in errors)
    assert _statuses(result["decode"]["ranks"]) == {"req-0": "FAILED"}
    untouched = c.call(d, Command(cmd="untouched", requests=[]), 30)
    assert untouched["problems"] == []


def test_malformed_frame_gets_error_and_loop_keeps_serving(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster(prefill_tp=1, decode_tp=1, layers=4, max_requests=1, max_prompt=128)
    d = c.sides["decode"]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(f"tcp://127.0.0.1:{d.control_port}")
    try:
        # Sealed with the key the sidecars share (per-user on loopback), so that what is tested
        # is the decoding behind the authentication.
        auth = load_auth(load_settings())
        sock.send_multipart([b"\x00" * 7 + b"\x01", auth.seal(b"\xc1 not msgpack")])
        assert sock.poll(5000)
        _, payload = sock.recv_multipart()
        reply = decode(auth.open(payload))
        assert isinstance(reply, Error) and "malformed" in reply.reason
        sock.send_multipart(
            [
                b"\x00" * 7 + b"\x02",
                auth.seal(msgspec.msgpack.encode({"type": "hello", "version": 99})),
            ]
        )
        assert sock.poll(5000)
        reply = decode(auth.open(sock.recv_multipart()[1]))
        assert isinstance(reply, Error) and "version" in reply.reason
        hello = Hello(compat_hash="nope", engine_id="x", role=Role.PREFILL)
        sock.send_multipart([b"\x00" * 7 + b"\x03", auth.seal(encode(hello))])
        assert sock.poll(5000)
        reply = decode(auth.open(sock.recv_multipart()[1]))
        assert isinstance(reply, Error | Rejected) and "model mismatch" in reply.reason
        # Unsealed, the same frame is refused before it is decoded.
        sock.send_multipart([b"\x00" * 7 + b"\x04", encode(hello)])
        assert sock.poll(5000)
        reply = decode(sock.recv_multipart()[1])
        assert isinstance(reply, Error) and "not authenticated" in reply.reason
    finally:
        ctx.destroy(0)
    pairs = c.make_requests([128])
    assert summarize(c.run(pairs), pairs)["verified"] == 1


def test_prefill_sigterm_tells_decode_at_once(make_cluster: Callable[..., Cluster]) -> None:
    """A prefill sidecar told to stop aborts what it could not finish within its grace period
    and says so to decode, which ends those requests ABORTED now instead of EXPIRED at its
    deadline (30 s here)."""
    c = make_cluster(
        prefill_tp=1,
        decode_tp=1,
        layers=4,
        max_requests=2,
        max_prompt=1024,
        sidecar_env=FAST,
        prefill_env={"KVSIDECAR_SHUTDOWN_GRACE_S": "0.5"},
    )
    p, d = c.sides["prefill"], c.sides["decode"]
    pairs = c.make_requests([1024, 1000])
    d_reqs = [dr for _, dr in pairs]
    c.call(d, Command(cmd="expect", requests=d_reqs, timeout_s=30), 30)
    # 4 layers x 8 chunks x 250 ms of compute: far from done when P is told to stop.
    c.send(
        p,
        Command(
            cmd="prefill", requests=[pr for pr, _ in pairs], chunk=128, compute_ms=250, timeout_s=30
        ),
    )
    time.sleep(1.5)
    t0 = time.monotonic()
    assert p.sidecar is not None
    p.sidecar.send_signal(signal.SIGTERM)
    out = c.call(d, Command(cmd="wait", requests=d_reqs, timeout_s=30), 60)
    assert time.monotonic() - t0 < 10
    (rank,) = out["ranks"]
    assert rank["done"] == []
    assert {k: v["status"] for k, v in rank["failed"].items()} == {
        "req-0": "ABORTED",
        "req-1": "ABORTED",
    }
    assert all("shutting down" in v["error"] for v in rank["failed"].values())


def test_dead_targets_leave_no_peer_behind(make_cluster: Callable[..., Cluster]) -> None:
    """Sends to decode sidecars that never answer fail at the handshake, and the prefill keeps
    no entry (nor socket) for them; a live decode afterwards is served as usual."""
    c = make_cluster(
        prefill_tp=1,
        decode_tp=1,
        layers=4,
        max_requests=4,
        max_prompt=256,
        prefill_env={"KVSIDECAR_HANDSHAKE_TIMEOUT_S": "0.5"},
    )
    p = c.sides["prefill"]
    dead = c.make_requests([256, 256, 256], prefix="dead")
    for pr, _ in dead:
        c.retarget(pr, port=free_port())  # nothing listens there
    out = c.call(p, Command(cmd="prefill", requests=[pr for pr, _ in dead], timeout_s=5), 60)
    assert set(_statuses(out["ranks"]).values()) == {"FAILED"}
    assert httpx.get(f"{p.admin_url}/v1/peers", timeout=10).json()["peers"] == []
    live = c.make_requests([256], prefix="live")
    assert summarize(c.run(live), live)["verified"] == 1
    assert len(httpx.get(f"{p.admin_url}/v1/peers", timeout=10).json()["peers"]) == 1


def test_repeated_done_is_acknowledged_once_counted(make_cluster: Callable[..., Cluster]) -> None:
    """A prefill that lost the ack retries its Done: decode acknowledges the repeat, counts it,
    and neither adds its bytes again nor ends the request a second time."""
    c = make_cluster(prefill_tp=1, decode_tp=1, layers=4, max_requests=1, max_prompt=256)
    d = c.sides["decode"]
    pairs = c.make_requests([256])
    assert summarize(c.run(pairs), pairs)["verified"] == 1
    rid = pairs[0][1].id
    entry = request_entry(d.admin_url, rid)
    assert entry["state"] == "DONE"
    groups = [g["group"] for g in entry["groups"]]
    repeat = Done(
        request=rid,
        sender_engine=c.sides["prefill"].engine_id,
        sender_rank=0,
        target_rank=0,
        epoch=d.info[0]["epoch"],
        status=Status.DONE,
        groups=groups,
        bytes=entry["bytes"],
    )
    auth = load_auth(load_settings())
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(f"tcp://127.0.0.1:{d.control_port}")
    try:
        for corr in (1, 2):
            sock.send_multipart([corr.to_bytes(8, "big"), auth.seal(encode(repeat))])
            assert sock.poll(5000)
            ack = decode(auth.open(sock.recv_multipart()[1]))
            assert isinstance(ack, Ack) and ack.ok, ack
    finally:
        ctx.destroy(0)
    after = request_entry(d.admin_url, rid)
    assert (after["state"], after["bytes"]) == ("DONE", entry["bytes"])
    metrics = httpx.get(f"{d.admin_url}/metrics", timeout=10).text
    assert "kvsidecar_duplicate_dones_total 2.0" in metrics
