"""The engine link's side of events, against a stand-in sidecar socket: ``layer_ready`` never
blocks on an event, a layer whose event is pending is signalled only once it completed, the
rank's signals keep their order, and with a ring every signal names its slot and use."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from app.engine_link.client import EngineLink
from app.transfer.wire.codec import decode
from app.transfer.wire.protocol import LayerReady
from tests.devices.harness import LateEvent


class FakeSidecar:
    def __init__(self, path: Path) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.endpoint = f"ipc://{path}"
        self.sock.bind(self.endpoint)

    def next(self, timeout_s: float) -> LayerReady | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        frames = self.sock.recv_multipart()
        msg = decode(frames[-1])
        assert isinstance(msg, LayerReady), msg
        return msg

    def close(self) -> None:
        self.ctx.destroy(0)


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[FakeSidecar]:
    s = FakeSidecar(tmp_path / "engine.sock")
    yield s
    s.close()


@pytest.fixture
def link(sidecar: FakeSidecar) -> Iterator[EngineLink]:
    lk = EngineLink(sidecar.endpoint, "engine-test", 0, timeout_s=2.0)
    yield lk
    lk.close()


def test_a_pending_event_defers_its_signal_and_those_after_it(
    sidecar: FakeSidecar, link: EngineLink
) -> None:
    ev = LateEvent()
    t0 = time.monotonic()
    link.layer_ready(1, 0, ev)
    link.layer_ready(1, 1)  # complete, but must not overtake layer 0
    assert time.monotonic() - t0 < 0.2, "layer_ready blocked on the event"
    assert sidecar.next(0.5) is None, "signalled before the event completed"
    ev.complete()
    first, second = sidecar.next(5), sidecar.next(5)
    assert first is not None and second is not None
    assert [(m.layer, m.slot) for m in (first, second)] == [(0, -1), (1, -1)]
    link.layer_ready(2, 0)  # nothing pending any more: straight through
    third = sidecar.next(5)
    assert third is not None and (third.step, third.layer) == (2, 0)


def test_with_a_ring_the_signal_goes_at_once_and_names_the_use(
    sidecar: FakeSidecar, link: EngineLink
) -> None:
    ring = link.create_event_ring(2, slots=2)
    ev = LateEvent()
    link.layer_ready(1, 0, ev)
    msg = sidecar.next(2)
    assert msg is not None and (msg.layer, msg.slot, msg.seq) == (0, 0, 1)
    link.layer_ready(1, 1)
    link.layer_ready(2, 0)
    got = [sidecar.next(2), sidecar.next(2)]
    assert [(m.layer, m.slot, m.seq) for m in got if m] == [(1, 0, 1), (0, 1, 2)]
    assert link.ring is ring
    ev.complete()


def test_close_drops_signals_still_waiting(sidecar: FakeSidecar, link: EngineLink) -> None:
    ev = LateEvent()
    link.layer_ready(1, 0, ev)
    t0 = time.monotonic()
    link.close()
    assert time.monotonic() - t0 < 2.0
    ev.complete()
    assert sidecar.next(0.3) is None
