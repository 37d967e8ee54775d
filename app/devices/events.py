"""The event ring: how a layer's reshape-cache event reaches the sidecar (DESIGN §2, steps 4-5).

Per engine rank and layer, ``slots`` slots used round-robin. Every use of a layer's ring has a
sequence number (from 1; use ``q`` lives in slot ``(q - 1) % slots``). A small POSIX
shared-memory table holds three int64 per (layer, slot): the last use *recorded* (written by the
engine), *completed* (the engine's waiter thread, ``shm`` kind) and *released* (the sidecar).
Every test compares sequence numbers, never flags, so a late or repeated release or wait about
an older use of a slot is never taken for its current use (ABA).

Which device takes which path:

- CPU (kind ``shm``): a CPU event is complete when recorded; ``record`` marks the use at once.
- NPU without interprocess events, and any event that is not complete yet on a ``shm`` ring: a
  waiter thread inside the engine process calls the event's own ``synchronize`` and then marks
  the use completed; the sidecar polls the table.
- CUDA (kind ``cuda``), and NPU where torch_npu offers interprocess events (kind ``npu``): the
  engine records the slot's interprocess event on a stream ordered after the reshape-cache
  event; the sidecar opened every slot's event once (``from_ipc_handle``) and polls ``query``.

The engine takes a slot only once the sidecar released the slot's previous use, and the sidecar
releases a use only when its stream thread is done with it (written, failed or given up), so an
event is never re-recorded while the sidecar still waits on it.
"""

from __future__ import annotations

import logging
import mmap
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.devices.base import CpuEvent, Event, available, backend
from app.devices.shm import create_file, open_file, unlink_file
from app.devices.spec import EventRingSpec
from app.errors import ConfigError, DeadlineExceeded, ProtocolError

log = logging.getLogger(__name__)

DEFAULT_SLOTS = 4
# The engine waits this long for a slot: longer than the sidecar's default send deadline, after
# which the sidecar releases whatever it waited on.
RECORD_TIMEOUT_S = 60.0
_MAGIC = 0x4B56534556524E47  # "KVSEVRNG"
_VERSION = 1
_HEADER = 8  # int64 words: magic, version, layers, slots, kind, reserved
_KIND_CODES = {"shm": 1, "cuda": 2, "npu": 3}
# Polling: start fine (a layer takes well under a millisecond), back off to bound the CPU cost.
_POLL_MIN_S = 20e-6
_POLL_MAX_S = 1e-3


def _table_bytes(layers: int, slots: int) -> int:
    return 8 * (_HEADER + 3 * layers * slots)


@dataclass
class _Table:
    """The sequence numbers of one ring, mapped in this process."""

    mm: mmap.mmap
    layers: int
    slots: int
    recorded: np.ndarray = field(init=False)
    completed: np.ndarray = field(init=False)
    released: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        words = np.frombuffer(self.mm, dtype=np.int64)
        n = self.layers * self.slots
        shape = (self.layers, self.slots)
        self.recorded = words[_HEADER : _HEADER + n].reshape(shape)
        self.completed = words[_HEADER + n : _HEADER + 2 * n].reshape(shape)
        self.released = words[_HEADER + 2 * n : _HEADER + 3 * n].reshape(shape)

    @property
    def header(self) -> np.ndarray:
        return np.frombuffer(self.mm, dtype=np.int64, count=_HEADER)


def _backoff(sleep: float) -> float:
    time.sleep(sleep)
    return min(sleep * 2, _POLL_MAX_S)


# ---- engine side -------------------------------------------------------------------------------


class EngineRing:
    """The engine's end: ``record(layer, event)`` takes the layer's next slot and arranges for
    the sidecar to see when ``event`` completed. Create with ``EngineRing.create``."""

    def __init__(
        self, spec: EventRingSpec, table: _Table, events: list[Any], timeout_s: float
    ) -> None:
        self.spec, self._table, self._events, self.timeout_s = spec, table, events, timeout_s
        self._next = [0] * spec.layers  # last sequence number used per layer
        self._lock = threading.Lock()  # marks of ``completed`` come from two threads
        self._pending: queue.SimpleQueue[tuple[int, int, int, Event] | None] = queue.SimpleQueue()
        self._waiter: threading.Thread | None = None
        self._side_stream: Any = None
        self._closed = False

    @classmethod
    def create(
        cls,
        layers: int,
        *,
        device: str = "cpu",
        index: int = 0,
        slots: int = DEFAULT_SLOTS,
        prefix: str | None = None,
        timeout_s: float = RECORD_TIMEOUT_S,
        kind: str | None = None,
    ) -> EngineRing:
        """A new ring for ``layers`` layers on ``device`` (cpu, cuda or npu). The kind follows
        the device (npu falls back to ``shm`` without interprocess events) unless ``kind``."""
        kind = kind or _ring_kind(device, index)
        name = f"{prefix or 'kvs'}-ev-{secrets.token_hex(4)}"
        table = _Table(create_file(name, _table_bytes(layers, slots)), layers, slots)
        table.header[:5] = (_MAGIC, _VERSION, layers, slots, _KIND_CODES[kind])
        events: list[Any] = []
        handles: tuple[bytes, ...] = ()
        uuid = ""
        try:
            if kind != "shm":
                events, handles, uuid = _interprocess_events(kind, index, layers * slots)
            spec = EventRingSpec(
                kind=kind,
                layers=layers,
                slots=slots,
                table=name,
                device=index,
                device_uuid=uuid,
                handles=handles,
            )
        except BaseException:
            unlink_file(name)
            raise
        return cls(spec, table, events, timeout_s)

    def record(self, layer: int, event: Event | None = None) -> tuple[int, int]:
        """Take ``layer``'s next slot for ``event`` (None: already complete); returns
        ``(slot, seq)`` for ``LayerReady``. Blocks while the sidecar still holds the slot's
        previous use, up to ``timeout_s``, then raises ``DeadlineExceeded``."""
        spec, t = self.spec, self._table
        if not 0 <= layer < spec.layers:
            raise ProtocolError(f"layer {layer} is outside this ring's {spec.layers} layers")
        seq = self._next[layer] + 1
        slot = (seq - 1) % spec.slots
        self._wait_released(layer, slot, seq - spec.slots)
        self._next[layer] = seq
        if spec.kind == "shm":
            t.recorded[layer, slot] = seq
            if event is None or isinstance(event, CpuEvent) or event.query():
                self._complete(layer, slot, seq)
            else:
                self._start_waiter()
                self._pending.put((layer, slot, seq, event))
        else:
            self._record_interprocess(layer, slot, event)
            # After the record: the sidecar trusts the slot's event only once it sees this.
            t.recorded[layer, slot] = seq
        return slot, seq

    def abandon(self, layer: int, slot: int, seq: int) -> None:
        """Use ``seq`` was recorded but its ``LayerReady`` never left this process: the
        sidecar will never release it, so the engine does (no sidecar write can race this one:
        the sidecar released the slot's previous use before ``record`` returned)."""
        released = self._table.released
        if seq > released[layer, slot]:
            released[layer, slot] = seq

    def _wait_released(self, layer: int, slot: int, prev: int) -> None:
        if prev <= 0:
            return
        released = self._table.released
        deadline = time.monotonic() + self.timeout_s
        sleep = _POLL_MIN_S
        while released[layer, slot] < prev:
            if time.monotonic() > deadline:
                raise DeadlineExceeded(
                    f"event ring: layer {layer} slot {slot} is still held by the sidecar for "
                    f"use {prev} after {self.timeout_s:g}s, so use {prev + self.spec.slots} "
                    "cannot take it; the sidecar is not keeping up with the forward pass, or "
                    "has stopped"
                )
            sleep = _backoff(sleep)

    def _record_interprocess(self, layer: int, slot: int, event: Event | None) -> None:
        be = backend(self.spec.kind)
        ev = self._events[layer * self.spec.slots + slot]
        if event is None or isinstance(event, CpuEvent):
            # The reshape-cache kernels ran on the current stream: everything before now.
            ev.record(be.current_stream(self.spec.device))
            return
        # Ordered after the engine's own event, on a side stream so that the compute stream
        # gets no extra dependency.
        if self._side_stream is None:
            self._side_stream = be.Stream(self.spec.device)
        self._side_stream.wait_event(event)
        ev.record(self._side_stream)

    def _complete(self, layer: int, slot: int, seq: int) -> None:
        with self._lock:
            done = self._table.completed
            done[layer, slot] = max(int(done[layer, slot]), seq)

    def _start_waiter(self) -> None:
        if self._waiter is None:
            self._waiter = threading.Thread(target=self._wait_events, name="kvs-ring", daemon=True)
            self._waiter.start()

    def _wait_events(self) -> None:
        # One thread, first in first out: events of one stream complete in that order anyway.
        while (item := self._pending.get()) is not None:
            layer, slot, seq, event = item
            try:
                event.synchronize()
            except Exception:
                # Not marked: the sidecar gives up on this use at its deadline, writing nothing.
                log.exception("event of layer %d (slot %d, use %d) failed", layer, slot, seq)
                continue
            self._complete(layer, slot, seq)

    def close(self, unlink: bool = True, timeout_s: float = 1.0) -> None:
        """Stop the waiter (one stuck in ``synchronize`` is left behind: it is a daemon) and
        remove the table's name; the sidecar's mapping stays valid."""
        if self._closed:
            return
        self._closed = True
        if self._waiter is not None:
            self._pending.put(None)
            self._waiter.join(timeout_s)
        if unlink:
            unlink_file(self.spec.table)


def _ring_kind(device: str, index: int) -> str:
    if device == "cpu":
        return "shm"
    if device == "cuda":
        return "cuda"
    if device == "npu":
        try:
            ev = backend("npu").Event(interprocess=True)
            ev.ipc_handle()
            return "npu"
        except (TypeError, RuntimeError, AttributeError, NotImplementedError):
            return "shm"  # no interprocess events in this torch_npu: the waiter-thread path
    raise ConfigError(f"device must be cpu, cuda or npu, not {device!r}")


def _interprocess_events(kind: str, index: int, n: int) -> tuple[list[Any], tuple[bytes, ...], str]:
    """``n`` interprocess events on device ``index``, their IPC handles and the device UUID."""
    be = backend(kind)
    if not available(kind):
        raise ConfigError(f"an event ring of kind {kind} needs a visible {kind} device")
    with be.device(index):
        # Created lazily on the current device by ``ipc_handle``: both inside this block.
        events = [
            be.Event(enable_timing=False, blocking=False, interprocess=True) for _ in range(n)
        ]
        handles = tuple(bytes(e.ipc_handle()) for e in events)
    return events, handles, _device_uuid(kind, index)


def _device_uuid(kind: str, index: int) -> str:
    props = backend(kind).get_device_properties(index)
    return str(getattr(props, "uuid", "") or "")


def device_by_uuid(kind: str, uuid: str, index: int) -> int:
    """This process's index of the device the engine calls ``index`` (UUID ``uuid``): the two
    may differ when the processes see different device lists. ConfigError if it is not seen."""
    be = backend(kind)
    if not available(kind):
        raise ConfigError(
            f"the engine shares {kind} memory or events, but this sidecar sees no {kind} device "
            f"(torch.{kind}.is_available() is False: a torch build without {kind}, or no device "
            "in this container); run the sidecar in the engine's pod with the same devices "
            "visible, or register CPU shared memory and shm events instead"
        )
    if not uuid:
        return index
    for i in range(int(be.device_count())):
        if _device_uuid(kind, i) == uuid:
            return i
    raise ConfigError(
        f"the engine's {kind} device {index} (UUID {uuid}) is not visible to this sidecar; "
        "give the sidecar the same devices as the engine (NVIDIA_VISIBLE_DEVICES / "
        "CUDA_VISIBLE_DEVICES, or ASCEND_RT_VISIBLE_DEVICES)"
    )


# ---- sidecar side ------------------------------------------------------------------------------


class SidecarRing:
    """The sidecar's end of one rank's ring, opened once at registration."""

    def __init__(self, spec: EventRingSpec, table: _Table, events: list[Any]) -> None:
        self.spec, self._table, self._events = spec, table, events

    @classmethod
    def open(cls, spec: EventRingSpec) -> SidecarRing:
        """Map the table and open the interprocess events; ConfigError when this process
        cannot (no such file, a different layout, no device)."""
        # The device first: without it the sentence to act on is that one.
        index = (
            0 if spec.kind == "shm" else device_by_uuid(spec.kind, spec.device_uuid, spec.device)
        )
        mm = open_file(spec.table, _table_bytes(spec.layers, spec.slots))
        table = _Table(mm, spec.layers, spec.slots)
        want = (_MAGIC, _VERSION, spec.layers, spec.slots, _KIND_CODES[spec.kind])
        got = tuple(int(x) for x in table.header[:5])
        if got != want:
            raise ConfigError(
                f"event ring {spec.table}: header {got} does not match the registration's "
                f"{want} (magic, version, layers, slots, kind)"
            )
        events: list[Any] = []
        if spec.kind != "shm":
            be = backend(spec.kind)
            try:
                events = [be.Event.from_ipc_handle(index, h) for h in spec.handles]
            except RuntimeError as e:
                raise ConfigError(
                    f"opening the engine's {spec.kind} events failed ({e}); the sidecar must "
                    "run on the engine's node with its device visible"
                ) from None
        return cls(spec, table, events)

    def check(self, layer: int, slot: int, seq: int) -> None:
        """ProtocolError unless (layer, slot, seq) names a use this ring can hold."""
        s = self.spec
        if not 0 <= layer < s.layers or not 0 <= slot < s.slots or seq < 1:
            raise ProtocolError(
                f"event ring: layer {layer} slot {slot} use {seq} is outside the registered "
                f"ring of {s.layers} layers x {s.slots} slots"
            )
        if (seq - 1) % s.slots != slot:
            raise ProtocolError(
                f"event ring: use {seq} of layer {layer} lives in slot {(seq - 1) % s.slots}, "
                f"not {slot}"
            )

    def done(self, layer: int, slot: int, seq: int) -> bool:
        """Whether use ``seq`` of (layer, slot) completed (a later use implies it did)."""
        t = self._table
        if self.spec.kind == "shm":
            return bool(t.completed[layer, slot] >= seq)
        if t.recorded[layer, slot] < seq:
            return False  # not recorded yet: an unrecorded event reads as complete
        if t.recorded[layer, slot] > seq:
            return True  # the slot was taken again, which needed this use released
        return bool(self._events[layer * self.spec.slots + slot].query())

    def wait(self, layer: int, slot: int, seq: int, timeout: float) -> None:
        """Block until use ``seq`` of (layer, slot) completed; ``DeadlineExceeded`` with a
        sentence naming it after ``timeout`` seconds."""
        self.check(layer, slot, seq)
        deadline = time.monotonic() + timeout
        sleep = _POLL_MIN_S
        while not self.done(layer, slot, seq):
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(
                    f"layer {layer}'s event (ring slot {slot}, use {seq}) did not complete "
                    f"within {timeout:.3g}s: the engine's reshape-cache work for it has not "
                    "finished (a stuck device stream or event); nothing was written for it"
                )
            sleep = _backoff(sleep)

    def release(self, layer: int, slot: int, seq: int) -> None:
        """The sidecar is done with use ``seq``: the engine may take the slot again. A release
        of an older use than the last one released changes nothing."""
        self.check(layer, slot, seq)
        released = self._table.released
        if seq > released[layer, slot]:
            released[layer, slot] = seq


@dataclass(frozen=True)
class RingWait:
    """A stream thread's event for one ``LayerReady``: the use (layer, slot, seq) of a ring,
    waited on until ``deadline`` (``time.monotonic``)."""

    ring: SidecarRing
    layer: int
    slot: int
    seq: int
    deadline: float

    def record(self) -> None:
        """Recorded by the engine; nothing to do on this side."""

    def synchronize(self) -> None:
        self.ring.wait(self.layer, self.slot, self.seq, max(0.0, self.deadline - time.monotonic()))

    def query(self) -> bool:
        return self.ring.done(self.layer, self.slot, self.seq)

    def release(self) -> None:
        self.ring.release(self.layer, self.slot, self.seq)


@dataclass(frozen=True)
class RefusedEvent:
    """A ``LayerReady`` whose event cannot be waited on (e.g. a slot without a registered
    ring): ``synchronize`` raises, so the stream thread fails the layer's requests."""

    reason: str

    def record(self) -> None:
        return None

    def synchronize(self) -> None:
        raise ProtocolError(self.reason)

    def query(self) -> bool:
        return False


class Gate:
    """A layer's completion as seen by the stream thread, for writes planned later.

    A send admitted before its target (concurrent dispatch) keeps the layers the engine
    signalled; the stream thread waits for each such layer's event in order and opens (or
    fails) its gate, and the replay written once the target arrives waits on the gate. So
    a replayed layer is never written before its event completed, and the ring slot goes
    back to the engine without waiting for decode.
    """

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error = ""

    def open(self, error: str = "") -> None:
        self._error = error
        self._done.set()

    def record(self) -> None:
        return None

    def synchronize(self) -> None:
        # Queued after the task that opens it on the same FIFO thread: set by now, unless that
        # task crashed; the bound only keeps a bug from hanging the thread.
        if not self._done.wait(5.0):
            raise DeadlineExceeded("the layer's event was never waited on; nothing written")
        if self._error:
            raise ProtocolError(self._error)

    def query(self) -> bool:
        return self._done.is_set() and not self._error
