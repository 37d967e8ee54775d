"""An engine stops waiting for a sidecar that died (issue 38 item 2), on real sidecar processes:
a call in flight when the sidecar is killed ends within about a second, and every later call
fails at once, instead of each waiting out the link's deadline. A sidecar that only stalls
keeps the link open, and calls wait their deadlines as before."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.errors import DeadlineExceeded, SidecarGone
from tests.devices.harness import PARAMS, Pair, start_pair

LINK_TIMEOUT_S = 10.0  # far above what a call to a dead sidecar may now take


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    sockets = Path(tempfile.mkdtemp(prefix="kvs-gone-", dir="/dev/shm"))  # short ipc paths
    p = start_pair(sockets, tmp_path, PARAMS)
    p.d.timeout_s = LINK_TIMEOUT_S
    try:
        yield p
    finally:
        p.close()
        shutil.rmtree(sockets, ignore_errors=True)


def test_a_call_waiting_on_a_killed_sidecar_ends_at_once_and_later_calls_fail_fast(
    pair: Pair,
) -> None:
    proc = pair.decode.proc
    assert not pair.d.sidecar_gone
    os.kill(proc.pid, signal.SIGSTOP)  # stalled: the link stays open, the call waits
    outcome: list[BaseException | None] = []
    call = threading.Thread(target=lambda: outcome.append(_error_of(pair.d.get_finished)))
    call.start()
    time.sleep(1.5)
    assert call.is_alive(), "a call to a stalled sidecar stopped waiting before its deadline"

    killed = time.monotonic()
    proc.send_signal(signal.SIGKILL)
    call.join(LINK_TIMEOUT_S + 5)
    took = time.monotonic() - killed
    assert isinstance(outcome[0], SidecarGone), outcome
    assert took < 1.5, f"the call waited {took:.1f}s after its sidecar died"

    assert pair.d.sidecar_gone
    for what in (pair.d.get_finished, lambda: pair.d.begin_step(1, [])):
        t0 = time.monotonic()
        assert isinstance(_error_of(what), SidecarGone)
        assert time.monotonic() - t0 < 0.2, "a call to a dead sidecar waited"


def test_a_stalled_sidecar_still_costs_the_deadline(pair: Pair) -> None:
    """Nothing proves a stopped process gone: its engine's blocks stay protected."""
    proc = pair.decode.proc
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        pair.d.timeout_s = 1.0
        t0 = time.monotonic()
        assert isinstance(_error_of(pair.d.get_finished), DeadlineExceeded)
        assert time.monotonic() - t0 >= 1.0
        assert not pair.d.sidecar_gone
    finally:
        os.kill(proc.pid, signal.SIGCONT)


def _error_of(call: object) -> BaseException | None:
    try:
        call()  # type: ignore[operator]
    except BaseException as e:
        return e
    return None
