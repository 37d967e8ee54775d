"""An engine whose sidecar died registers the same memory with the sidecar that replaces it, and
transfers resume without an engine restart (issue 38 item 2), on real sidecar processes and
Mooncake over loopback TCP. The memory's /dev/shm names are gone by then (vLLM's connector
removes them once the first sidecar mapped them), so only the files the link kept open can
reach the new sidecar."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from app.sim.fill import request_salt
from app.sim.kv_io import verify_request, write_tokens
from app.transfer.wire.protocol import StepSlice
from tests.conftest import wait_for
from tests.devices.harness import PARAMS, Pair, restart_sidecar, start_pair

pytestmark = pytest.mark.timeout(240)

PROMPT = 64  # four 16-token blocks


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    sockets = Path(tempfile.mkdtemp(prefix="kvs-rereg-", dir="/dev/shm"))  # short ipc paths
    p = start_pair(sockets, tmp_path, PARAMS)
    try:
        yield p
    finally:
        p.close()
        shutil.rmtree(sockets, ignore_errors=True)


def test_a_restarted_sidecar_gets_the_same_memory_and_transfers_resume(pair: Pair) -> None:
    assert pair.decode.kv is not None
    pair.decode.kv.shm.unlink()
    old_epoch = pair.d.epoch
    assert not pair.d.reregister(), "registered again with the sidecar it registered with"

    pair.decode.proc.kill()
    wait_for("decode's link to see its sidecar gone", lambda: pair.d.sidecar_gone, 5)
    assert not pair.d.reregister(), "registered again with no sidecar there"
    restart_sidecar(pair, "decode")
    t0 = time.monotonic()
    wait_for("decode to register with the new sidecar", pair.d.reregister, 10)
    assert pair.d.epoch != old_epoch, "the link kept the dead sidecar's epoch"
    assert not pair.d.reregister(), "registered twice with one sidecar"
    print(f"registered again {time.monotonic() - t0:.2f}s after the new sidecar was up")

    rid = "after-restart"
    p_ids = [np.arange(1, 5, dtype=np.int64)]
    d_ids = [np.arange(9, 13, dtype=np.int64)]
    salt = request_salt(rid)
    layers = sorted(pair.p_layout.placements)
    for layer in layers:
        write_tokens(pair.p_layout, layer, p_ids[0], 0, PROMPT, salt)
    pair.d.expect_receive(rid, PROMPT, d_ids, prefill_tp=1)
    pair.send(rid, PROMPT, p_ids, d_ids)
    pair.p.begin_step(1, [StepSlice(rid, 0, PROMPT)])
    for layer in layers:
        pair.p.layer_ready(1, layer)
    assert pair.wait_end(pair.d, rid, 30) == "DONE"
    assert pair.wait_end(pair.p, rid, 30) == "DONE"
    # Landed in the engine's own memory, the same the first sidecar had.
    assert verify_request(pair.d_layout, d_ids, PROMPT, salt=salt) == []
