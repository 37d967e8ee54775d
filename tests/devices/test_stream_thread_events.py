"""The stream thread on its own (in-process writer): it writes a layer only after the task's
event completed, fails the layer's requests with the event's sentence when the wait runs out,
and gives the ring slot back after the task in every case."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from app.devices.events import EngineRing, RingWait, SidecarRing
from app.errors import TransferError
from app.kvcache.layout import KVLayout, LayoutMode
from app.kvcache.presets import load_preset
from app.sim.reference import build_instance
from app.transfer.planning.planner import PairPlanner, StepRequest
from app.transfer.requests.stream import Batch, LayerResult, LayerTask, StreamThread
from tests.devices.harness import LateEvent


class Recorder:
    def __init__(self, fail: bool = False) -> None:
        self.writes: list[int] = []
        self.results: list[LayerResult] = []
        self.fail = fail
        self.ended = threading.Event()

    def write(self, session: str, src: np.ndarray, dst: np.ndarray, ln: np.ndarray) -> None:
        self.writes.append(int(ln.sum()))
        if self.fail:
            raise TransferError("injected write failure")

    def on_result(self, res: LayerResult) -> None:
        self.results.append(res)
        self.ended.set()


@pytest.fixture
def batch() -> Batch:
    spec = load_preset("llama-3.1-8b", layers=2)
    p = build_instance(spec, 1, 16, 16, mode=LayoutMode.PER_LAYER, kv_layout=KVLayout.HND)
    d = build_instance(spec, 1, 16, 16, mode=LayoutMode.PER_LAYER, kv_layout=KVLayout.HND)
    planner = PairPlanner(p.descs[0], dict(enumerate(d.descs)))
    step = StepRequest("r1", 64, 0, 64, (np.arange(1, 5),), (np.arange(5, 9),))
    return Batch("tcp://peer:1", "peer", planner, [step])


@pytest.fixture
def stream() -> Iterator[Callable[[Recorder], StreamThread]]:
    made: list[StreamThread] = []

    def make(rec: Recorder) -> StreamThread:
        s = StreamThread(
            "test", 4, rec.write, rec.on_result, lambda e, ids: list(ids), lambda ids: None
        )
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


def _task(ring: EngineRing, batch: Batch, event: LateEvent, wait_s: float) -> LayerTask:
    slot, seq = ring.record(0, event)
    wait = RingWait(SidecarRing.open(ring.spec), 0, slot, seq, time.monotonic() + wait_s)
    return LayerTask(1, 0, wait, [batch], release=wait.release)


def test_writes_wait_for_the_event_and_release_the_slot_after(
    make_ring: Callable[..., EngineRing],
    batch: Batch,
    stream: Callable[[Recorder], StreamThread],
) -> None:
    ring = make_ring(layers=2, slots=1, timeout_s=0.5)
    rec, ev = Recorder(), LateEvent()
    stream(rec).put(_task(ring, batch, ev, 10.0), 1)
    time.sleep(0.3)
    assert rec.writes == [] and rec.results == []
    ev.complete()
    assert rec.ended.wait(5)
    assert rec.writes == [4 * 65536] and rec.results[0].ok == ["r1"]
    assert ring.record(0) == (0, 2)  # released: the slot's next use goes through


def test_a_wait_that_runs_out_fails_the_requests_and_writes_nothing(
    make_ring: Callable[..., EngineRing],
    batch: Batch,
    stream: Callable[[Recorder], StreamThread],
) -> None:
    ring = make_ring(layers=2, slots=1, timeout_s=0.5)
    rec, ev = Recorder(), LateEvent()
    t0 = time.monotonic()
    stream(rec).put(_task(ring, batch, ev, 0.3), 1)
    assert rec.ended.wait(5)
    assert 0.3 <= time.monotonic() - t0 < 2
    assert rec.writes == []
    (res,) = rec.results
    assert res.ok == [] and list(res.failed) == ["r1"]
    assert "layer 0's event (ring slot 0, use 1) did not complete within" in res.failed["r1"]
    assert ring.record(0) == (0, 2)  # given back even though it never completed
    ev.complete()


def test_a_failed_write_still_releases_the_slot(
    make_ring: Callable[..., EngineRing],
    batch: Batch,
    stream: Callable[[Recorder], StreamThread],
) -> None:
    ring = make_ring(layers=2, slots=1, timeout_s=0.5)
    rec, ev = Recorder(fail=True), LateEvent()
    ev.complete()
    stream(rec).put(_task(ring, batch, ev, 10.0), 1)
    assert rec.ended.wait(5)
    assert rec.writes and "injected write failure" in rec.results[0].failed["r1"]
    assert ring.record(0) == (0, 2)
