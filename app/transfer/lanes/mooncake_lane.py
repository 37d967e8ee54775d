"""The pieces of ``MooncakeEngine`` (``mooncake.py``) that write to one peer.

A ``Lane`` is one Mooncake ``TransferEngine`` used only for writes to one peer, with that peer's
in-flight budget, its writers, its generation and its counters. ``Registered`` is an engine plus
the spans registered on it, so that dropping the engine unregisters exactly what it holds. When a
lane is opened, reopened or closed is decided by ``lane_pool.LanePool``; the measurements behind
the constants here are in ``mooncake.py``'s module docstring.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from app.errors import TransferError

__all__ = [
    "DRAIN_TIMEOUT_S",
    "LANE_QUEUE_LIMIT",
    "OK",
    "Counters",
    "Lane",
    "LaneStats",
    "Registered",
]

# Descriptors in flight to one peer that the TCP lane accepted here; more poisons the session.
LANE_QUEUE_LIMIT = 2048
# Bounds how long a reopen or close waits for writes on the engine it drops; one chunk is itself
# bounded by the engine's 30 s progress timeout.
DRAIN_TIMEOUT_S = 120.0
OK = 0
# transfer_check_status: 1 landed (the engine freed the id), 0 still going, -1 failed, -2 timed out.
_LANDED, _GOING = 1, 0
# transfer_submit_write returns -1 as an unsigned id when it refuses; this wheel returned 0.
_REFUSED_IDS = frozenset({0, (1 << 64) - 1})
# A polled write gives up like the engine's own sync calls: 30 s plus 1 s per GiB.
_POLL_GRACE_S = 30.0
_POLL_MIN_RATE = float(1 << 30)
# Sleeps between polls double from the first to the cap while nothing lands: a landing is seen
# at most ~0.2 ms late.
_POLL_FIRST_S, _POLL_CAP_S = 20e-6, 200e-6
# With the lane's recent rate known, a poll that finds bytes still in flight first sleeps this
# share of the time they should take (each wake-up then finds most of what was left landed), up
# to the cap: a 32-descriptor 8 MiB layer took ~100 wake-ups with the doubling sleeps alone (the
# sleep restarted from 20 us after every landing, ~100 us apart), ~1.5 ms of the stream thread's
# CPU per write; with the estimate, a handful.
_NAP_SHARE, _NAP_CAP_S = 0.75, 0.02
# Writes of at least this many bytes update the rate (smaller ones are mostly fixed costs). A
# faster write sets it, a slower one pulls it this share of the way down: too high a rate costs a
# few more polls, too low one sleeps past landings, and a write measured after a long nap or a
# stall on a busy host reads slow (followed at once, the estimate fed on itself: a 64k transfer
# ended 2 s behind its forward pass on a loaded host).
_RATE_MIN_BYTES, _RATE_SLOWER = 1 << 20, 0.1


class Counters:
    """Aggregate counters of one ``MooncakeEngine``; its lanes add to them under ``lock``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.submits = 0
        self.descriptors = 0
        self.bytes = 0
        self.failures = 0
        self.reopens = 0

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {
                "submits": self.submits,
                "descriptors": self.descriptors,
                "bytes": self.bytes,
                "failures": self.failures,
                "reopens": self.reopens,
            }


@dataclass(frozen=True)
class LaneStats:
    """One lane at one instant. ``session`` is the lane engine's own ``host:rpc_port`` (what the
    peer sees writing to it), ``failures`` counts write calls to the peer that failed on the wire
    and ``inflight`` descriptors submitted and not yet landed."""

    peer: str
    session: str
    generation: int
    submits: int
    descriptors: int
    bytes: int
    failures: int
    reopens: int
    inflight: int


class Registered:
    """A ``TransferEngine`` and the spans registered on it."""

    def __init__(self, engine: Any, session: str) -> None:
        self.engine: Any = engine
        self.session = session
        self.ptrs: set[int] = set()

    def register(self, items: Sequence[tuple[int, int]]) -> None:
        """Register every span in one call; none of them stays registered if it fails."""
        if not items:
            return
        rc = self.engine.batch_register_memory([p for p, _ in items], [n for _, n in items])
        if rc != OK:
            # The batch may have registered a prefix; drop it so the engine matches ``ptrs``.
            for p, _ in items:
                self.engine.unregister_memory(p)
            raise TransferError(
                f"batch_register_memory of {len(items)} span(s) on {self.session} returned {rc}, "
                f"expected 0 (first span {items[0][0]:#x}+{items[0][1]})"
            )
        self.ptrs.update(p for p, _ in items)

    def unregister(self, ptrs: Iterable[int]) -> None:
        """Unregister these spans; every one is tried before the first failure is raised."""
        todo = [p for p in ptrs if p in self.ptrs]
        self.ptrs.difference_update(todo)
        bad = [(p, rc) for p in todo if (rc := self.engine.unregister_memory(p)) != OK]
        if bad:
            p, rc = bad[0]
            raise TransferError(
                f"unregister_memory on {self.session} failed for {len(bad)} of {len(todo)} "
                f"span(s): {p:#x} returned {rc}, expected 0"
            )

    def discard(self) -> None:
        """Unregister everything and drop the engine.

        No memory of ours stays registered with an engine we drop. Its destructor then takes up
        to ~1 s with the GIL held: better now than at some later garbage collection.
        """
        if self.engine is None:
            return
        try:
            self.unregister(list(self.ptrs))
        finally:
            self.engine = None


class Lane:
    """Writes to ``peer`` through an engine of its own.

    ``cond`` guards the fields writers touch (``rec``, ``generation``, ``users``, ``writers``,
    ``reopening``, ``closed``, ``inflight``); ``admin`` serialises this lane's reopen and close.
    ``rec`` and ``pending`` change only under ``MooncakeEngine``'s admin lock as well, so a
    registration reaches every engine that may be written from.
    """

    def __init__(
        self, peer: str, rec: Registered, counters: Counters, *, window: int, poll: bool
    ) -> None:
        self.peer = peer
        self.rec = rec
        self.pending: Registered | None = None  # the replacement while a reopen drains
        self.cond = threading.Condition()
        self.admin = threading.Lock()
        self.generation = 0
        self.users = 0  # writes between lane lookup and their return: never evicted under them
        self.writers = 0  # writes on ``rec.engine`` now: a reopen or close drains them
        self.reopening = False
        self.closed = False
        self.inflight = 0
        self._counters = counters
        self._window = window
        self._poll = poll
        self.rate: float | None = None  # bytes/s of recent polled writes (their naps)
        self.submits = self.descriptors = self.bytes = self.failures = self.reopens = 0

    def stats(self) -> LaneStats:
        with self.cond:
            session, generation, inflight = self.rec.session, self.generation, self.inflight
        with self._counters.lock:
            return LaneStats(
                self.peer,
                session,
                generation,
                self.submits,
                self.descriptors,
                self.bytes,
                self.failures,
                self.reopens,
                inflight,
            )

    # ------------------------------------------------------------------ writers

    def pin(self) -> None:
        with self.cond:
            self.users += 1

    def unpin(self) -> None:
        with self.cond:
            self.users -= 1
            self.cond.notify_all()

    def enter(self) -> tuple[Any, str, int]:
        """Wait out a reopen of this lane, then count as a writer on its engine."""
        with self.cond:
            if not self.cond.wait_for(lambda: not self.reopening, timeout=DRAIN_TIMEOUT_S):
                raise TransferError(
                    f"reopen of the lane to {self.peer} did not finish within "
                    f"{DRAIN_TIMEOUT_S:.0f} s; write not sent"
                )
            if self.closed:
                raise TransferError(f"the lane to {self.peer} was closed; write not sent")
            self.writers += 1
            return self.rec.engine, self.rec.session, self.generation

    def leave(self) -> None:
        with self.cond:
            self.writers -= 1
            self.cond.notify_all()

    def count(
        self,
        *,
        submits: int = 0,
        landed: int = 0,
        nbytes: int = 0,
        failures: int = 0,
        reopens: int = 0,
    ) -> None:
        c = self._counters
        with c.lock:
            self.submits += submits
            c.submits += submits
            self.descriptors += landed
            c.descriptors += landed
            self.bytes += nbytes
            c.bytes += nbytes
            self.failures += failures
            c.failures += failures
            self.reopens += reopens
            c.reopens += reopens

    def take_budget(self, k: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.inflight + k <= LANE_QUEUE_LIMIT)
            self.inflight += k

    def return_budget(self, k: int) -> None:
        with self.cond:
            self.inflight -= k
            self.cond.notify_all()

    # ------------------------------------------------------------------- writes

    def write(self, engine: Any, src: list[int], dst: list[int], length: list[int]) -> str | None:
        """Write every descriptor; None if all landed, else what failed."""
        if self._poll:
            return self._write_polled(engine, src, dst, length)
        return self._write_batches(engine, src, dst, length)

    def _write_batches(
        self, engine: Any, src: list[int], dst: list[int], length: list[int]
    ) -> str | None:
        """``spin``: sync batch calls of at most ``window`` descriptors."""
        total = len(src)
        for start in range(0, total, self._window):
            end = min(start + self._window, total)
            nbytes = sum(length[start:end])
            self.take_budget(end - start)
            try:
                rc = engine.batch_transfer_sync_write(
                    self.peer, src[start:end], dst[start:end], length[start:end]
                )
            finally:
                self.return_budget(end - start)
            ok = rc == OK
            self.count(submits=1, landed=end - start if ok else 0, nbytes=nbytes if ok else 0)
            if not ok:
                return (
                    f"batch_transfer_sync_write returned {rc}, expected 0, for descriptors "
                    f"{start}..{end - 1} ({end - start} descriptors, {nbytes} bytes; "
                    f"{start} landed before)"
                )
        return None

    def _write_polled(
        self, engine: Any, src: list[int], dst: list[int], length: list[int]
    ) -> str | None:
        """``poll``: one transfer per descriptor, a sliding window of them in flight, landings
        polled oldest first."""
        total = len(src)
        window = self._window
        t0 = time.monotonic()
        deadline = t0 + _POLL_GRACE_S + sum(length) / _POLL_MIN_RATE
        pending: deque[int] = deque()  # transfer ids of descriptors landed..sent-1
        landed = sent = 0
        flying = 0  # bytes of the pending descriptors
        pause = _POLL_FIRST_S
        try:
            while landed < total:
                if sent < total and len(pending) < window:
                    k = min(window - len(pending), total - sent)
                    self.take_budget(k)
                    for i in range(sent, sent + k):
                        tid = engine.transfer_submit_write(self.peer, src[i], dst[i], length[i])
                        if tid in _REFUSED_IDS:
                            self.return_budget(sent + k - i)
                            self.count(submits=i - sent + 1)
                            return (
                                f"transfer_submit_write refused descriptor {i} ({length[i]} "
                                f"bytes; {landed} landed before)"
                            )
                        pending.append(tid)
                    flying += sum(length[sent : sent + k])
                    sent += k
                    self.count(submits=k)
                done = nbytes = 0
                while pending:
                    rc = engine.transfer_check_status(pending[0])
                    if rc == _GOING:
                        break
                    if rc != _LANDED:
                        i = landed + done
                        self._finish_polled(done, nbytes)
                        return (
                            f"transfer_check_status returned {rc}, expected 1, for descriptor "
                            f"{i} ({length[i]} bytes; {i} landed before)"
                        )
                    pending.popleft()
                    nbytes += length[landed + done]
                    done += 1
                if done:
                    landed += done
                    flying -= nbytes
                    self._finish_polled(done, nbytes)
                    pause = _POLL_FIRST_S
                    if landed == total or sent < total:
                        continue  # finished, or the window has room for more first
                elif time.monotonic() > deadline:
                    return (
                        f"descriptor {landed} ({length[landed]} bytes) had not landed "
                        f"{time.monotonic() - t0:.0f} s after the write began; {landed} landed "
                        "before"
                    )
                # Until most of what is in flight (while descriptors wait for room in the
                # window: the oldest) should have landed.
                time.sleep(self._nap(flying if sent == total else length[landed], pause))
                if not done:
                    pause = min(2 * pause, _POLL_CAP_S)
            self._measure(sum(length), time.monotonic() - t0)
            return None
        finally:
            # Failed or abandoned transfers no longer count against the peer: the engine that
            # holds them is replaced before the failure is raised.
            if pending:
                self.return_budget(len(pending))

    def _nap(self, nbytes: int, pause: float) -> float:
        """The sleep before the next poll, ``nbytes`` being in flight: a share of their time at
        the lane's recent rate, at least ``pause``."""
        rate = self.rate
        if rate is None:
            return pause
        return max(pause, min(_NAP_SHARE * nbytes / rate, _NAP_CAP_S))

    def _measure(self, nbytes: int, seconds: float) -> None:
        """Fold one whole write's rate into the lane's estimate, quick to rise and slow to fall
        (racing writers may lose an update: it is an estimate)."""
        if nbytes < _RATE_MIN_BYTES or seconds <= 0:
            return
        rate, old = nbytes / seconds, self.rate
        self.rate = rate if old is None or rate > old else old + _RATE_SLOWER * (rate - old)

    def _finish_polled(self, landed: int, nbytes: int) -> None:
        if landed:
            self.return_budget(landed)
            self.count(landed=landed, nbytes=nbytes)
