"""A sidecar dies (SIGKILL) or is told to stop (SIGTERM) while layers are flowing."""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest

from tests.chaos.harness import LENS, Chaos, Outcome

# Minutes of simulated-cluster faults: CI runs them apart (pytest -m slow_chaos).
pytestmark = pytest.mark.slow_chaos

# A short lease: the survivor may end the dead peer's requests before any deadline.
LEASE = {"KVSIDECAR_HEARTBEAT_INTERVAL_S": "0.5", "KVSIDECAR_LEASE_S": "2"}


def test_decode_sidecar_killed_mid_transfer(chaos: Callable[..., Chaos]) -> None:
    """Prefill's writes and Dones fail; decode's engine, its sidecar gone, fails its own."""
    ch = chaos(
        "D sidecar SIGKILL mid-transfer",
        sidecar_env={**LEASE, "KVSIDECAR_SEND_TIMEOUT_S": "20", "KVSIDECAR_RECV_TIMEOUT_S": "20"},
    )
    ch.start(LENS, deadline_s=20)
    ch.wait_written()
    ch.at_fault()
    ch.signal_sidecar("decode", signal.SIGKILL)

    def expect(o: Outcome) -> list[str]:
        out = []
        if set(o.status["prefill"].values()) != {"FAILED"}:
            out.append(f"scenario: prefill should fail every request: {o.status['prefill']}")
        if o.seconds is None or o.seconds > 15:
            out.append(f"scenario: took {o.seconds}s to end, expected < 15 s")
        return out

    ch.verify(expect=expect)


def test_prefill_sidecar_killed_mid_transfer(chaos: Callable[..., Chaos]) -> None:
    """Decode ends its requests (at the lease, at its deadline at worst); prefill's engine,
    its sidecar gone, fails its own."""
    ch = chaos("P sidecar SIGKILL mid-transfer", sidecar_env=LEASE)
    ch.start(LENS, deadline_s=10)
    ch.wait_written()
    ch.at_fault()
    ch.signal_sidecar("prefill", signal.SIGKILL)

    def expect(o: Outcome) -> list[str]:
        out = []
        if "DONE" in o.status["decode"].values():
            out.append(f"scenario: decode cannot complete without prefill: {o.status['decode']}")
        if o.seconds is None or o.seconds > 12:
            out.append(f"scenario: took {o.seconds}s to end, expected < 12 s")
        return out

    ch.verify(expect=expect)


def test_prefill_sidecar_sigterm_mid_transfer(chaos: Callable[..., Chaos]) -> None:
    """A graceful stop: prefill aborts what it cannot finish within its grace period and
    tells decode, which ends those requests ABORTED at once, not at its deadline (30 s)."""
    ch = chaos(
        "P sidecar SIGTERM mid-transfer",
        prefill_env={"KVSIDECAR_SHUTDOWN_GRACE_S": "0.5"},
        sidecar_env={"KVSIDECAR_SEND_TIMEOUT_S": "30", "KVSIDECAR_RECV_TIMEOUT_S": "30"},
    )
    ch.start(LENS, deadline_s=30, compute_ms=80)
    ch.wait_written()
    ch.at_fault()
    ch.signal_sidecar("prefill", signal.SIGTERM)

    def expect(o: Outcome) -> list[str]:
        out = []
        if set(o.status["decode"].values()) != {"ABORTED"}:
            out.append(f"scenario: decode should end every request ABORTED: {o.status['decode']}")
        late = [rid for rid in o.status["decode"] if (o.at("decode", rid) or 1e9) - ch.fault_at > 8]  # type: ignore[operator]
        if late:
            out.append(f"scenario: decode ended {late} more than 8 s after SIGTERM")
        return out

    ch.verify(expect=expect)
