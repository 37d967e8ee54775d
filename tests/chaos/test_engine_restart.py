"""An engine restarts behind a live sidecar: a new engine process on the same ranks allocates
new KV memory and registers again.

The contract (a re-registration starts a new *generation*): the old generation's in-flight
requests end FAILED on both sides, the old memory is unregistered (the sidecar lets go of the
dead engine's segments), peers re-handshake, and requests after the restart arrive byte-exact
in the new memory, with nothing written into the old one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from app.sim.rounds import summarize
from tests.chaos.harness import LENS, Chaos, Outcome, mapped_by

# Minutes of simulated-cluster faults: CI runs them apart (pytest -m slow_chaos).
pytestmark = pytest.mark.slow_chaos

ENV = {"KVSIDECAR_SEND_TIMEOUT_S": "45", "KVSIDECAR_RECV_TIMEOUT_S": "45"}


def _handshakes(admin: str) -> int:
    """Handshakes this sidecar completed since it started (peer entries may be replaced)."""
    return int(httpx.get(f"{admin}/v1/status", timeout=10).json()["handshakes"])


def _still_mapped(ch: Chaos, role: str, prefix: str, wait_s: float = 5.0) -> list[str]:
    """Old-generation segments the sidecar still maps (given a moment to let go)."""
    proc = ch.side(role).sidecar
    assert proc is not None
    deadline = time.monotonic() + wait_s
    while (left := mapped_by(proc.pid, prefix)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _after_restart(ch: Chaos, *, decode_restarted: bool) -> list[str]:
    """New requests after the restart: byte-exact, nothing outside their read sets."""
    fresh = ch.c.make_requests([1024, 896], prefix="after")
    s = summarize(ch.c.run(fresh, chunk=256, timeout_s=20), fresh)
    out = []
    if s["verified"] != len(fresh) or s["failures"]:
        out.append(
            f"scenario: requests after the restart: {s['verified']}/2 byte-exact, "
            f"failures {s['failures']}"
        )
    done = [dr for pr, dr in fresh if pr.id not in s["failures"]]
    if decode_restarted:
        # In the new engine's memory, which check 2 (on the old one) does not see.
        changed, problems = ch.c.changed_outside(fresh, done=[dr.id for dr in done])
        if changed or problems:
            out.append(
                f"scenario: after the restart, decode's new memory changed outside the "
                f"read sets: {problems[:3]}"
            )
    else:
        ch.after += done  # the same memory as the old requests: check 2 sees both
    ch.notes.append(f"after restart {s['verified']}/{len(fresh)} byte-exact")
    return out


def _verify(ch: Chaos, problems: list[str]) -> None:
    """The common checks, the scenario's ``problems``, and the old generation FAILED."""

    def expect(o: Outcome) -> list[str]:
        out = list(problems)
        for role in ("prefill", "decode"):
            if set(o.status[role].values()) != {"FAILED"}:
                out.append(
                    f"scenario: old generation on {role} should end FAILED: {o.status[role]}"
                )
        return out

    ch.verify(expect=expect)


def test_decode_engine_restarted_behind_live_sidecar(chaos: Callable[..., Chaos]) -> None:
    ch = chaos("D engine restart (new generation)", sidecar_env=ENV)
    p_admin = ch.p.admin_url
    # Slow layers (8 chunks x 8 layers x 400 ms): every old request is still in flight when the
    # new engine registers (a restart takes 5-15 s on a busy 2-core machine); prefill's engine
    # stops computing them once they ended.
    ch.start(LENS, deadline_s=45, compute_ms=400)
    ch.wait_written()
    handshakes = _handshakes(p_admin)
    old_prefix = f"{Path(ch.c.tmp).name}-decode-r"  # generation 0's segments
    ch.at_fault()
    ch.engine_gone.add("decode")
    ch.awaiting.discard("decode")
    ch.c.restart_engines(ch.d)
    ch.collect()  # prefill's old requests end first: its engine runs one command at a time
    problems = _after_restart(ch, decode_restarted=True)
    if _handshakes(p_admin) <= handshakes:
        problems.append("scenario: prefill did not handshake again with the new generation")
    left = _still_mapped(ch, "decode", old_prefix)
    if left:
        problems.append(f"scenario: decode's sidecar still maps the old engine's memory {left}")
    _verify(ch, problems)


def test_prefill_engine_restarted_behind_live_sidecar(chaos: Callable[..., Chaos]) -> None:
    ch = chaos("P engine restart (new generation)", sidecar_env=ENV)
    # Slow layers (8 chunks x 8 layers x 400 ms): every old request is still in flight when the
    # new engine registers (a restart takes 5-15 s on a busy 2-core machine); prefill's engine
    # stops computing them once they ended.
    ch.start(LENS, deadline_s=45, compute_ms=400)
    ch.wait_written()
    old_prefix = f"{Path(ch.c.tmp).name}-prefill-r"
    ch.at_fault()
    ch.engine_gone.add("prefill")
    ch.awaiting.discard("prefill")
    ch.c.restart_engines(ch.p)
    ch.collect()  # decode's wait for the old requests
    problems = _after_restart(ch, decode_restarted=False)
    left = _still_mapped(ch, "prefill", old_prefix)
    if left:
        problems.append(f"scenario: prefill's sidecar still maps the old engine's memory {left}")
    _verify(ch, problems)
