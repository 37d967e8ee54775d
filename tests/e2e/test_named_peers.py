"""Only the prefill that claimed a request may write it, complete it or end it; decode holds an
ended request's blocks until that prefill drained."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import httpx

from app.sim.cluster import Cluster
from app.sim.commands import Command
from app.sim.rounds import summarize
from app.transfer.wire.protocol import Abort, Ack, Claim, Done, Status
from tests.conftest import wait_for
from tests.e2e.conftest import ask_control, request_entry


def test_unclaimed_engine_cannot_claim_complete_or_abort(
    make_cluster: Callable[..., Cluster],
) -> None:
    """A peer with the key but not the request's prefill: its Claim naming other blocks, its
    Done and its Abort change nothing; the real prefill then serves the request byte-exact."""
    c = make_cluster(prefill_tp=1, decode_tp=1, layers=4, max_requests=2, max_prompt=256)
    p, d = c.sides["prefill"], c.sides["decode"]
    pairs = c.make_requests([256, 256])
    (_, victim), (_, other) = pairs
    c.call(d, Command(cmd="expect", requests=[victim, other], timeout_s=30, prefill_tp=1), 30)
    epoch = str(d.info[0]["epoch"])
    groups = list(range(len(victim.blocks)))

    wrong = Claim(
        request=victim.id,
        sender_engine="mallory",
        sender_rank=0,
        target_rank=0,
        epoch=epoch,
        block_ids=other.blocks,  # another request's blocks: a misrouted target
    )
    reply = ask_control(d.control_port, wrong)
    assert isinstance(reply, Ack) and not reply.ok
    assert "are not request" in (reply.error or "")

    forged = Done(
        request=victim.id,
        sender_engine="mallory",
        sender_rank=0,
        target_rank=0,
        epoch=epoch,
        status=Status.DONE,
        groups=groups,
        bytes=1 << 20,
    )
    reply = ask_control(d.control_port, forged)
    assert isinstance(reply, Ack) and not reply.ok and "did not claim" in (reply.error or "")
    ask_control(d.control_port, Abort(request=victim.id, reason="x", sender_engine="mallory"))
    entry = request_entry(d.admin_url, victim.id)
    assert (entry["state"], entry["bytes"]) == ("PENDING", 0), entry
    metrics = httpx.get(f"{d.admin_url}/metrics", timeout=10).text
    assert "kvsidecar_refused_claims_total 1.0" in metrics

    # The real prefill claims (the blocks are the request's own) and completes both.
    started = time.monotonic()
    c.send(p, Command(cmd="prefill", requests=[pr for pr, _ in pairs], timeout_s=30))
    c.send(d, Command(cmd="wait", requests=[victim, other], timeout_s=30))
    out = {"prefill": c.recv(p, 90), "decode": c.recv(d, 90), "started": started}
    assert summarize(out, pairs)["verified"] == 2


def test_decode_abort_holds_blocks_while_prefill_may_still_write(
    make_cluster: Callable[..., Cluster],
) -> None:
    """Decode aborts a request whose prefill is frozen mid-transfer (SIGSTOP): decode ends it
    at once but does not hand it to its engine (quarantine). Losing the prefill's lease does
    not release it (a frozen prefill still writes when it wakes up): only the prefill's answer,
    its sidecar's end, or ``quarantine_max_s`` do. The prefill, woken up, ends its side too."""
    lease, quarantine_max = 2.0, 6.0
    env = {
        "KVSIDECAR_ACK_TIMEOUT_S": "2",
        "KVSIDECAR_LEASE_S": str(lease),
        "KVSIDECAR_HEARTBEAT_INTERVAL_S": "0.5",
        "KVSIDECAR_QUARANTINE_MAX_S": str(quarantine_max),
    }
    c = make_cluster(
        prefill_tp=1, decode_tp=1, layers=4, max_requests=1, max_prompt=1024, sidecar_env=env
    )
    p, d = c.sides["prefill"], c.sides["decode"]
    pairs = c.make_requests([1024])
    ((pr, dr),) = pairs
    c.call(d, Command(cmd="expect", requests=[dr], timeout_s=60, prefill_tp=1), 30)
    # 4 layers x 8 chunks x 250 ms: mid-transfer when frozen.
    c.send(p, Command(cmd="prefill", requests=[pr], chunk=128, compute_ms=250, timeout_s=60))
    time.sleep(1.5)
    assert p.sidecar is not None
    os.kill(p.sidecar.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        r = httpx.post(f"{d.admin_url}/v1/requests/{dr.id}/abort", timeout=10)
        assert r.status_code == 200, r.text
        entry = request_entry(d.admin_url, dr.id)
        assert (entry["state"], entry["quarantined"]) == ("ABORTED", True), entry
        metrics = httpx.get(f"{d.admin_url}/metrics", timeout=10).text
        assert "kvsidecar_quarantine_requests 1.0" in metrics
        wait_for(
            "the quarantine to end",
            lambda: not request_entry(d.admin_url, dr.id)["quarantined"],
            15,
        )
        held = time.monotonic() - t0
        assert quarantine_max * 0.9 <= held <= quarantine_max + 5, held
        out = c.call(d, Command(cmd="wait", requests=[dr], timeout_s=10), 30)
        (rank,) = out["ranks"]
        assert rank["failed"][dr.id]["status"] == "ABORTED"
    finally:
        os.kill(p.sidecar.pid, signal.SIGCONT)
    # Woken up, prefill hears it was declared lost (or that its lease is stale) and stops.
    out = c.recv(p, 60)
    (rank,) = out["ranks"]
    assert rank["done"] == [] and rank["failed"][pr.id]["status"] in ("FAILED", "ABORTED")
