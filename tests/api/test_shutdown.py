"""SIGTERM mid-transfer: stop admitting, drain for shutdown_grace_s, abort the rest, exit 0."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
from collections.abc import Callable

import httpx
import numpy as np
import pytest

from app.engine_link.client import EngineLink, EngineLinkError
from app.sim.cluster import Cluster
from app.sim.commands import Command
from tests.api.conftest import Batch, sidecar_log, statuses, wait_for

GRACE_S = 2.0  # KVSIDECAR_SHUTDOWN_GRACE_S of the suite's cluster


def _shutdown_report(log: str) -> dict[str, int]:
    lines = [ln for ln in log.splitlines() if ln.startswith('{"shutdown"')]
    assert lines, f"no shutdown report in the sidecar's log:\n{log[-2000:]}"
    report: dict[str, int] = json.loads(lines[-1])["shutdown"]
    return report


def test_sigterm_mid_transfer(
    cluster: Cluster,
    make_batch: Callable[[str, int], Batch],
    prefill: httpx.Client,
    decode: httpx.Client,
) -> None:
    p, d = cluster.sides["prefill"], cluster.sides["decode"]
    assert d.sidecar is not None
    batch = make_batch("shut", 3)
    # 8 chunks x 4 layers x 150 ms: prefill needs ~5 s, longer than the grace. Decode's engine
    # stays idle (no wait), so its driver socket is free to stop it cleanly afterwards.
    batch.start(compute_ms=150, wait_at_decode=False)
    ids = set(batch.ids)
    log_start = len(sidecar_log(cluster, "decode"))
    try:
        wait_for(
            "the batch to be moving",
            lambda: (
                sum(
                    r["bytes"] > 0
                    for r in prefill.get("/v1/requests", params={"state": "TRANSFERRING"}).json()[
                        "requests"
                    ]
                    if r["id"] in ids
                )
                == len(ids)
            ),
        )
        t0 = time.monotonic()
        d.sidecar.send_signal(signal.SIGTERM)

        # Stops admitting: out of rotation, and a new request is refused with a reason.
        def refusing() -> bool:
            r = decode.get("/readyz")
            return r.status_code == 503 and r.json()["reason"].startswith("shutting down")

        wait_for("decode /readyz to report shutting down", refusing, timeout_s=GRACE_S)
        assert decode.get("/v1/status").json()["admitting"] is False
        probe = EngineLink(d.ipc, "probe", 0, timeout_s=5)
        try:
            with pytest.raises(EngineLinkError, match="shutting down; not admitting"):
                probe.expect_receive("shut-late", 512, [np.zeros(0, np.int64)] * 4, 1)
        finally:
            probe.close()

        rc = d.sidecar.wait(timeout=GRACE_S + 20)
        elapsed = time.monotonic() - t0
        assert rc == 0
        # It drained for the grace period (the transfers were still running), then aborted.
        assert GRACE_S - 0.2 <= elapsed < GRACE_S + 15, elapsed
        report = _shutdown_report(sidecar_log(cluster, "decode")[log_start:])
        assert report["aborted"] == len(ids), report

        # Prefill's copies end too, within their deadlines: nothing hangs.
        out = cluster.recv(p, 60)
        assert set(statuses(out)) >= ids
        assert {statuses(out)[i] for i in ids} <= {"FAILED", "ABORTED"}
    finally:
        # Decode stays stopped (the next module that needs it starts it); its engine exits on
        # its own so that it unlinks its shared memory.
        cluster.send(d, Command(cmd="exit"))
        with contextlib.suppress(subprocess.TimeoutExpired):
            d.engines[0].wait(10)
        cluster.kill_side(d)
        cluster.release(batch.pairs)
