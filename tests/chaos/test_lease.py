"""A peer silent past its lease (SIGSTOP for three leases, then SIGCONT).

The contract: sidecars that share requests heartbeat each other every
``KVSIDECAR_HEARTBEAT_INTERVAL_S``; a peer that answered nothing for ``KVSIDECAR_LEASE_S`` is
declared dead and every request with it ends FAILED on the live side at once, well before the
requests' deadline (60 s here, so that only the lease can explain a prompt end). When the
stopped side wakes up, its requests end too, exactly once, and none of them DONE.

A stopped *decode* still has prefill's writes on the wire: prefill ends the requests at the
lease but gives its engine the source blocks back only once Mooncake answered those writes
(decode woke up), since until then they are still read from.

A stopped *prefill* is not a dead one: its transfer engine finishes the write it had started
when it wakes up. So decode ends the requests at the lease but keeps their blocks quarantined
(its engine is not told) until the prefill, awake, answers that it stopped writing; no byte
lands in blocks decode's engine freed (check 2's ``late``).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import httpx
import pytest

from tests.chaos.harness import LENS, Chaos, Outcome

# Minutes of simulated-cluster faults: CI runs them apart (pytest -m slow_chaos).
pytestmark = pytest.mark.slow_chaos

LEASE_S = 2.0
STOP_S = 3 * LEASE_S
DEADLINE_S = 60.0
# Declared dead one lease after the last heartbeat answered, plus a heartbeat interval and
# the engine's polling: a few seconds at most, against a deadline of 60.
LIVE_BOUND_S = LEASE_S + 3.0
ENV = {
    "KVSIDECAR_HEARTBEAT_INTERVAL_S": "0.5",
    "KVSIDECAR_LEASE_S": str(LEASE_S),
    "KVSIDECAR_SEND_TIMEOUT_S": str(DEADLINE_S),
    "KVSIDECAR_RECV_TIMEOUT_S": str(DEADLINE_S),
}


@pytest.mark.parametrize("stopped", ["prefill", "decode"])
def test_peer_silent_past_its_lease(chaos: Callable[..., Chaos], stopped: str) -> None:
    live = "decode" if stopped == "prefill" else "prefill"
    ch = chaos(
        f"{stopped[0].upper()} sidecar SIGSTOP {STOP_S:g}s (lease {LEASE_S:g}s)",
        sidecar_env=ENV,
        # The stopped side's engine blocks in a call to its sidecar until SIGCONT: let it.
        engine_link_timeout_s=30.0,
        engine_link_lease_s=None,
    )
    ch.start(LENS, deadline_s=DEADLINE_S, driver_s=DEADLINE_S + 10)
    ch.wait_written()
    fault = ch.at_fault()
    ch.signal_sidecar(stopped, signal.SIGSTOP)
    ch.sidecar_gone.add(stopped)  # checked for /livez again after SIGCONT, below
    time.sleep(LIVE_BOUND_S)
    ids = [pr.id for pr, _ in ch.pairs]
    held = _states(ch.d.admin_url, ids, "recv") if stopped == "prefill" else {}
    ended = _states(ch.p.admin_url, ids, "send") if stopped == "decode" else {}
    time.sleep(STOP_S - LIVE_BOUND_S)
    ch.signal_sidecar(stopped, signal.SIGCONT)
    ch.sidecar_gone.discard(stopped)

    def expect(o: Outcome) -> list[str]:
        out = []
        if stopped == "prefill":
            # Ended within the lease, blocks held: the engine hears once prefill answered.
            if held != {pr.id: ("FAILED", True) for pr, _ in ch.pairs}:
                out.append(
                    f"scenario: {LIVE_BOUND_S:g}s into the stop, decode should hold every "
                    f"request FAILED and quarantined: {held}"
                )
        else:
            # Ended within the lease; a write still on the wire to the stopped decode keeps
            # prefill's blocks from its engine until Mooncake answers it (decode woke up).
            if {state for state, _ in ended.values()} != {"FAILED"}:
                out.append(
                    f"scenario: {LIVE_BOUND_S:g}s into the stop, prefill should have ended "
                    f"every request FAILED: {ended}"
                )
        # Either way the engine hears once the stopped side is awake and answered.
        bound, when = STOP_S + 3.0, f"after the stop ({stopped} woke up at {STOP_S:g}s)"
        if set(o.status[live].values()) != {"FAILED"}:
            out.append(
                f"scenario: the live side ({live}) should fail every request: {o.status[live]}"
            )
        slow = {
            rid: None if (t := o.at(live, rid)) is None else round(t - fault, 2)
            for rid in o.status[live]
            if (o.at(live, rid) or float("inf")) - fault > bound
        }
        if slow:
            out.append(f"scenario: the live side ({live}) ended {slow} (seconds) {when}")
        if "DONE" in o.status[stopped].values():
            out.append(
                f"scenario: the stopped side ({stopped}) must not complete requests its "
                f"peer declared dead: {o.status[stopped]}"
            )
        return out

    ch.verify(expect=expect)


def _states(admin: str, ids: list[str], side: str) -> dict[str, tuple[str, bool]]:
    """One side's view of each request: (state, quarantined)."""
    out = {}
    for rid in ids:
        entries = httpx.get(f"{admin}/v1/requests/{rid}", timeout=10).json()["entries"]
        mine = [e for e in entries if e["side"] == side]
        found = (mine[0]["state"], bool(mine[0].get("quarantined"))) if mine else ("unknown", False)
        out[rid] = found
    return out
