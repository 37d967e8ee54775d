"""A ring slot is taken again only after the sidecar released its previous use; an engine
that waits too long gets a sentence that names the layer, the slot and the use."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from app.devices.events import EngineRing, SidecarRing
from app.errors import DeadlineExceeded

SLOTS = 3


def test_n_plus_one_records_wait_for_a_release(make_ring: Callable[..., EngineRing]) -> None:
    ring = make_ring(layers=2, slots=SLOTS)
    side = SidecarRing.open(ring.spec)
    uses = [ring.record(0) for _ in range(SLOTS)]
    assert uses == [(s, s + 1) for s in range(SLOTS)]
    assert ring.record(1) == (0, 1)  # layers have their own slots

    got: list[tuple[int, int]] = []
    t = threading.Thread(target=lambda: got.append(ring.record(0)))
    t.start()
    time.sleep(0.3)
    assert got == [], "took slot 0 while the sidecar still held use 1"
    side.release(0, 1, 2)  # another slot's use: does not free slot 0
    time.sleep(0.2)
    assert got == []
    side.release(0, 0, 1)
    t.join(5)
    assert got == [(0, SLOTS + 1)]


def test_a_slot_never_released_ends_in_a_deadline(make_ring: Callable[..., EngineRing]) -> None:
    ring = make_ring(layers=1, slots=2, timeout_s=0.3)
    ring.record(0)
    ring.record(0)
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded) as e:
        ring.record(0)
    assert 0.3 <= time.monotonic() - t0 < 2.0
    assert "layer 0 slot 0 is still held by the sidecar for use 1" in str(e.value)
    assert "use 3 cannot take it" in str(e.value)
    # The failed record took nothing: once released, the same use goes through.
    SidecarRing.open(ring.spec).release(0, 0, 1)
    assert ring.record(0) == (0, 3)
