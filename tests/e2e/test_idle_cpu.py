"""An idle sidecar costs under 1% of a core: nothing in it polls while no request is in flight.

A P/D pair moves a few requests (so every path has run once), then sits idle; each sidecar
process's CPU time over the idle window, read from ``/proc``, must stay under 1% of it.
Catches a timer that wakes the loop without work: the deadline watcher polling every 20 ms
while idle fails it (1.6% here). Before this test, it polled every 50 ms while idle: 0.9% on
this pair, 1.1% on ``demo --keep-alive``'s; it now sleeps until an engine speaks (0.6%, the
rest is the 1 s heartbeats).

The same pair checks that a CPU sidecar that moved requests never loaded torch: 2-3 s of a core
at every start here, and none of its work needs it (CUDA and NPU sidecars import it for their
device memory only).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from app.sim.cluster import Cluster
from app.sim.rounds import summarize

IDLE_S = 10.0
BUDGET = 0.01  # of one core


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_idle_sidecar_uses_under_one_percent_of_a_core(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster(
        model="llama-3.1-8b", layers=4, prefill_tp=1, decode_tp=1, max_requests=2, max_prompt=256
    )
    pairs = cluster.make_requests([256, 130])
    s = summarize(cluster.run(pairs, chunk=128), pairs)
    assert s["failures"] == {} and s["verified"] == len(pairs), s
    time.sleep(1.0)  # the last Done's acks and reports settle
    pids = {role: side.sidecar.pid for role, side in cluster.sides.items() if side.sidecar}
    assert set(pids) == {"prefill", "decode"}
    torch_loaded = {
        role: "libtorch" in Path(f"/proc/{pid}/maps").read_text() for role, pid in pids.items()
    }
    assert torch_loaded == {"prefill": False, "decode": False}, torch_loaded
    before = {role: _cpu_s(pid) for role, pid in pids.items()}
    t0 = time.monotonic()
    time.sleep(IDLE_S)
    took = time.monotonic() - t0
    share = {role: (_cpu_s(pid) - before[role]) / took for role, pid in pids.items()}
    print(f"idle sidecars, share of a core over {took:.1f} s: {share}")
    assert all(s < BUDGET for s in share.values()), share
