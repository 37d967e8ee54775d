"""Sequence numbers, not flags: an old use of a slot is never taken for its current use."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from app.devices.events import EngineRing, SidecarRing
from app.errors import DeadlineExceeded, ProtocolError
from tests.devices.harness import LateEvent


def test_a_stale_release_does_not_free_a_reused_slot(
    make_ring: Callable[..., EngineRing],
) -> None:
    ring = make_ring(layers=1, slots=2, timeout_s=0.3)
    side = SidecarRing.open(ring.spec)
    assert ring.record(0) == (0, 1)
    assert ring.record(0) == (1, 2)
    side.release(0, 0, 1)
    assert ring.record(0) == (0, 3)  # slot 0 reused
    side.release(0, 0, 1)  # late duplicate of the first release
    side.release(0, 1, 2)
    assert ring.record(0) == (1, 4)
    with pytest.raises(DeadlineExceeded):
        ring.record(0)  # use 5 needs use 3 released, which nobody did
    side.release(0, 0, 3)
    assert ring.record(0) == (0, 5)


def test_a_wait_for_the_new_use_is_not_met_by_the_old_one(
    make_ring: Callable[..., EngineRing],
) -> None:
    ring = make_ring(layers=1, slots=1)
    side = SidecarRing.open(ring.spec)
    assert ring.record(0) == (0, 1)  # complete at once (no event)
    side.wait(0, 0, 1, 0.1)
    side.release(0, 0, 1)
    late = LateEvent()
    assert ring.record(0, late) == (0, 2)
    assert side.done(0, 0, 1)  # the old use stays complete...
    assert not side.done(0, 0, 2)  # ...and says nothing about the new one
    with pytest.raises(DeadlineExceeded, match=r"layer 0's event \(ring slot 0, use 2\)"):
        side.wait(0, 0, 2, 0.2)
    late.complete()
    side.wait(0, 0, 2, 5)
    assert late.synchronized == 1  # the engine's waiter thread did the waiting


def test_uses_that_do_not_belong_to_the_slot_are_refused(
    make_ring: Callable[..., EngineRing],
) -> None:
    ring = make_ring(layers=2, slots=4)
    side = SidecarRing.open(ring.spec)
    with pytest.raises(ProtocolError, match="use 6 of layer 1 lives in slot 1, not 0"):
        side.check(1, 0, 6)
    for bad in [(2, 0, 1), (0, 4, 5), (0, 0, 0), (-1, 0, 1)]:
        with pytest.raises(ProtocolError, match="outside the registered ring"):
            side.check(*bad)


def test_events_complete_in_the_waiter_thread_not_in_record(
    make_ring: Callable[..., EngineRing],
) -> None:
    ring = make_ring(layers=1, slots=2)
    side = SidecarRing.open(ring.spec)
    ev = LateEvent()
    done = threading.Event()
    threading.Thread(target=lambda: (ring.record(0, ev), done.set())).start()
    assert done.wait(1), "record blocked on the event"
    assert not side.done(0, 0, 1)
    ev.complete()
    side.wait(0, 0, 1, 5)
