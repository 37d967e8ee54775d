"""An idle sidecar does nothing: nothing in it polls while no request is in flight.

A P/D pair moves a few requests (so every path has run once), then sits idle; over the idle
window each sidecar process may wake (voluntary context switches of all its threads, read from
``/proc``) at most ``WAKEUPS_PER_S`` times a second: the 1 s heartbeats, the admin API's 1 s
tick and ZMQ's I/O thread make about 9 here. Catches a timer that wakes the loop without work:
the deadline watcher polling every 20 ms while idle added 50 a second, uvicorn's own 10 Hz tick
9. Wakeups, not CPU time, are
the budget: what a wakeup costs is the host's (an empty asyncio wakeup took 0.6 ms of CPU on
one VM and a tenth of that on another, so the same sidecar measured 0.6% and 1.7% of a core).
A loop that spins without sleeping is caught by the CPU bound, set far above any wakeup cost.

The same pair checks that a CPU sidecar that moved requests never loaded torch: 2-3 s of a core
at every start here, and none of its work needs it (CUDA and NPU sidecars import it for their
device memory only).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from app.sim.cluster import Cluster
from app.sim.rounds import summarize

IDLE_S = 10.0
WAKEUPS_PER_S = 15.0
SPIN_BUDGET = 0.10  # of one core: a spinning loop takes all of it


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wakeups(pid: int) -> int:
    """Voluntary context switches of every thread of ``pid`` (each ends a sleep)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:  # the thread ended
            continue
        total += int(status.split("voluntary_ctxt_switches:")[1].split()[0])
    return total


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
    before = {role: (_cpu_s(pid), _wakeups(pid)) for role, pid in pids.items()}
    t0 = time.monotonic()
    time.sleep(IDLE_S)
    took = time.monotonic() - t0
    share = {role: (_cpu_s(pid) - before[role][0]) / took for role, pid in pids.items()}
    rate = {role: (_wakeups(pid) - before[role][1]) / took for role, pid in pids.items()}
    print(f"idle sidecars over {took:.1f} s: wakeups a second {rate}, share of a core {share}")
    assert all(r <= WAKEUPS_PER_S for r in rate.values()), rate
    assert all(s < SPIN_BUDGET for s in share.values()), share


def test_a_quietly_waiting_request_does_not_make_its_sidecar_poll(
    make_cluster: Callable[..., Cluster],
) -> None:
    """A request decode waits for while prefill holds it queued (no message for seconds, as
    through a long prefill's chunk): decode's sidecar wakes no more than an idle one. The
    deadline watcher used to poll every 50 ms while any request was in flight (20 more
    wakeups a second); it now sleeps until the earliest deadline or a message that may move
    one."""
    cluster = make_cluster(
        model="llama-3.1-8b", layers=4, prefill_tp=1, decode_tp=1, max_requests=2, max_prompt=256
    )
    pairs = cluster.make_requests([256])
    result: dict[str, object] = {}
    run = threading.Thread(target=lambda: result.update(cluster.run(pairs, queued_s=5.0)))
    run.start()
    time.sleep(1.0)  # decode admitted the request; prefill sits on it
    side = cluster.sides["decode"].sidecar
    assert side is not None
    before, t0 = _wakeups(side.pid), time.monotonic()
    time.sleep(3.0)
    rate = (_wakeups(side.pid) - before) / (time.monotonic() - t0)
    run.join(30)
    s = summarize(result, pairs)
    assert s["failures"] == {} and s["verified"] == len(pairs), s
    print(f"decode's sidecar while its request waits: {rate:.1f} wakeups a second")
    assert rate <= WAKEUPS_PER_S, rate
