"""A thread-safe wrapper over the real Mooncake ``TransferEngine`` (DESIGN §6).

Two ways to wait for a write (``EngineConfig.wait``):

- ``poll`` (default): every descriptor is its own ``transfer_submit_write``, at most
  ``max_descriptors_per_submit`` in flight per call, and the caller polls
  ``transfer_check_status`` with short sleeps. The engine's batch calls busy-spin the waiting
  thread until the whole batch lands, which on a small host takes the core the TCP sender and
  receiver need: on this 2-core machine polling moved 256 KiB descriptors ~8% faster at less than
  half the CPU, and 4-16 KiB ones at the same rate for half the CPU.
- ``spin``: ``batch_transfer_sync_write`` chunks of at most ``max_descriptors_per_submit``.

Writes go through per-peer lanes (``mooncake_lane.py``, managed by ``lane_pool.py``, which also
holds ``EngineConfig`` and starts every local engine). The engine built at construction only
receives: its ``session_id`` is the address peers write to, and no failed write replaces it. Writes
to peer X go through X's lane, a ``TransferEngine`` of its own opened on the first write to X, with
every span registered on it as well. A failed write to X replaces only that engine (a new one with
every span registered, X's other writers drained, the new one swapped in, the old one's spans
unregistered) and bumps ``lane_generation(X)``; writes to other peers stay on their own engines,
connections and in-flight budgets and never wait for it. The one stall lanes cannot isolate is the
old engine's destructor, which holds the GIL (below). At most ``lane_pool._MAX_LANES`` lanes are
open: opening one more closes the least recently used idle one, and ``close_lane`` drops the lane
of a peer that is gone. (Mooncake's own "TCP lane", below, is its per-peer queue inside one
engine.)

Measured with wheel 0.3.13.post1 over loopback TCP on a 2-core machine:

- Return codes are all ``-1`` for failed writes; ``register_memory`` gives ``-7`` for an
  overlapping or repeated span and ``unregister_memory`` ``-3`` for an unknown one.
- A write to an address outside the peer's registered buffers fails cleanly: the target logs
  "not within any registered buffer" and the call returns ``-1`` within ~2 ms. One such
  descriptor leaves the session usable. A *batch* of k rejected descriptors does not: the call
  returns ``-1`` on the first rejection while the lane keeps draining the rest at about four per
  second, so the next call to that peer on the same engine waits ~k/4 s (1000 rejected: it failed
  after 29 s). A fresh engine reached the same peer at once. Since ``-1`` cannot tell this from
  a single rejection or from the permanent "queue-full" poisoning, every failed submit reopens.
- "TCP lane queue-full" counts descriptors in flight to one peer across all threads: one
  batch of 2048, or two concurrent batches of 1024, passed; 2500 in one batch, or two concurrent
  batches of 1200 to one peer, failed and poisoned the session for good (``send_probe``
  still answered 0, writes kept failing). Two concurrent batches of 1500 to *different* peers
  passed, so the wrapper caps in-flight descriptors per peer at 2048.
- The source side is not checked over TCP: a source address outside every local registration was
  read and sent (rc 0). ``write_sync`` therefore bound-checks sources against its own spans.
- A peer that stops reading (SIGSTOP) makes a write fail after the engine's 30 s "no transfer
  progress" timeout; a killed peer fails at once.
- Registering the same memory on a second engine while the first still holds it returns 0, and
  both engines then read it; this is what lets every lane register every span. A lane costs 3
  threads and 6 file descriptors and its first write 1-5 ms (initialize, registration, handshake).
- Destroying a ``TransferEngine`` takes 0.1-1 s and holds the GIL throughout (the destructor
  joins its handshake listener, which polls ``accept`` with a 1 s timeout), so every reopen or
  lane close stalls every Python thread, the event loop and writes to other peers included, for
  up to a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt

from app.errors import TransferError
from app.transfer.lanes.lane_pool import EngineConfig, LanePool, Wait
from app.transfer.lanes.mooncake_lane import LaneStats, Registered

# EngineConfig and Wait live with the engines they configure (lane_pool); re-exported here, where
# callers build a MooncakeEngine.
__all__ = ["EngineConfig", "LaneStats", "MooncakeEngine", "Wait"]

_DEFAULT_CONFIG = EngineConfig()  # frozen, so one instance can be every engine's default


def _as_u64(name: str, arr: Any) -> npt.NDArray[np.uint64]:
    a = np.asarray(arr)
    if a.ndim != 1:
        raise TransferError(f"{name} must be a 1-D array, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise TransferError(f"{name} must hold integers, got dtype {a.dtype}")
    if a.size and a.dtype.kind == "i" and int(a.min()) < 0:
        raise TransferError(f"{name} must not hold negative values, got min {int(a.min())}")
    return a.astype(np.uint64, copy=False)


class MooncakeEngine(LanePool):
    """A receiving Mooncake ``TransferEngine``, a lane per peer written to, and the
    registrations and recovery around them.

    Aggregate counters, over every lane ever open: ``submits`` counts submissions an engine
    accepted or refused (a batch per chunk when spinning, one per descriptor when polling),
    ``descriptors`` and ``bytes`` what an engine confirmed written, ``failures`` write calls that
    raised (injected ones and failed source checks included), ``reopens`` lane engines replaced.
    ``lane_stats`` has the same per open lane.

    The locks, and the order they are taken in, are ``LanePool``'s; ``_guard`` also covers the
    published spans.
    """

    def __init__(self, config: EngineConfig = _DEFAULT_CONFIG) -> None:
        super().__init__(config)
        # Sorted copies of the spans for the per-write source check; swapped under _guard.
        self._span_starts = np.empty(0, dtype=np.uint64)
        self._span_ends = np.empty(0, dtype=np.uint64)
        self._inject_remaining = 0  # under _counters.lock

        self._recv: Registered | None = Registered(*self._start_engine())
        self._session_id = self._recv.session
        self._pool = ThreadPoolExecutor(
            max_workers=config.spin_threads, thread_name_prefix="mooncake-spin"
        )

    # ----------------------------------------------------------------- introspection

    @property
    def config(self) -> EngineConfig:
        """The configuration this engine was built with."""
        return self._config

    @property
    def session_id(self) -> str:
        """``host:rpc_port`` of the receiving engine, the address peers write to; never changes."""
        return self._session_id

    @property
    def generation(self) -> int:
        """Replacements of the receiving engine: always 0, failed writes replace only lanes."""
        return 0

    @property
    def spans(self) -> list[tuple[int, int]]:
        """Every remembered registration as ``(ptr, length)``, in address order."""
        with self._admin_lock:
            return sorted(self._spans.items())

    @property
    def submits(self) -> int:
        """Submissions made to an engine, failed ones included."""
        return self.counters()["submits"]

    @property
    def descriptors(self) -> int:
        """Descriptors confirmed written."""
        return self.counters()["descriptors"]

    @property
    def bytes(self) -> int:
        """Bytes confirmed written."""
        return self.counters()["bytes"]

    @property
    def failures(self) -> int:
        """Write calls that raised, injected failures included."""
        return self.counters()["failures"]

    @property
    def reopens(self) -> int:
        """Lane engines replaced after a failed submit."""
        return self.counters()["reopens"]

    def counters(self) -> dict[str, int]:
        """All aggregate counters taken at one instant."""
        return self._counters.snapshot()

    # ------------------------------------------------------------------ registration

    def register(self, ptr: int, length: int) -> None:
        """Register ``[ptr, ptr + length)`` with every engine and remember it for new ones."""
        self.register_many([(ptr, length)])

    def register_many(self, spans: Sequence[tuple[int, int]]) -> None:
        """Register several spans with the receiving engine and every lane (one call per engine);
        all or none are remembered."""
        items = [(int(p), int(n)) for p, n in spans]
        if not items:
            return
        for p, n in items:
            if p <= 0 or n <= 0:
                raise TransferError(f"span must have ptr > 0 and length > 0, got ({p:#x}, {n})")
        with self._admin_lock:
            self._check_open()
            known = sorted([*self._spans.items(), *items])
            for (p0, n0), (p1, n1) in itertools.pairwise(known):
                if p0 + n0 > p1:
                    raise TransferError(
                        f"span ({p1:#x}, {n1}) overlaps ({p0:#x}, {n0}); the engine "
                        "rejects overlapping registrations"
                    )
            done: list[Registered] = []
            try:
                for rec in self._registered():
                    rec.register(items)
                    done.append(rec)
            except TransferError:
                for rec in done:
                    with contextlib.suppress(TransferError):
                        rec.unregister([p for p, _ in items])
                raise
            self._spans.update(items)
            self._publish_spans()

    def unregister_all(self) -> None:
        """Unregister every remembered span from every engine and forget them."""
        with self._admin_lock:
            self._spans.clear()
            self._publish_spans()
            errors: list[TransferError] = []
            for rec in self._registered():
                try:
                    rec.unregister(list(rec.ptrs))
                except TransferError as exc:
                    errors.append(exc)
            if errors:
                raise errors[0]

    def _registered(self) -> list[Registered]:
        """Every engine a registration must reach; caller holds ``_admin_lock``."""
        with self._guard:
            lanes = list(self._lanes.values())
        recs = [] if self._recv is None else [self._recv]
        for lane in lanes:
            recs.append(lane.rec)
            if lane.pending is not None:
                recs.append(lane.pending)
        return recs

    def _publish_spans(self) -> None:
        items = sorted(self._spans.items())
        starts = np.array([p for p, _ in items], dtype=np.uint64)
        ends = np.array([p + n for p, n in items], dtype=np.uint64)
        with self._guard:
            self._span_starts, self._span_ends = starts, ends

    # ------------------------------------------------------------------------ writes

    def inject_failures(self, n: int) -> None:
        """Make the next ``n`` write calls raise TransferError before touching the wire."""
        if n < 0:
            raise TransferError(f"inject_failures needs n >= 0, got {n}")
        with self._counters.lock:
            self._inject_remaining += n

    def write_sync(
        self,
        peer: str,
        src: npt.NDArray[Any],
        dst: npt.NDArray[Any],
        length: npt.NDArray[Any],
    ) -> None:
        """Blocking: write every ``src[i] -> dst[i]`` of ``length[i]`` bytes to ``peer``.

        At most ``max_descriptors_per_submit`` descriptors are in flight (or in one batch) at a
        time. A failed write replaces the lane to ``peer`` (see the module docstring), then raises
        TransferError saying how many descriptors landed before the failure; later ones may or
        may not have. Every failure costs a reopen (up to ~1 s with the GIL held), so stop
        writing to a peer that keeps failing, and ``close_lane`` it.
        """
        self._check_open()
        s, d, n = _as_u64("src", src), _as_u64("dst", dst), _as_u64("length", length)
        if not s.size == d.size == n.size:
            raise TransferError(
                f"src, dst and length must have equal sizes, got {s.size}, {d.size}, {n.size}"
            )
        c = self._counters
        with c.lock:
            if self._inject_remaining > 0:
                self._inject_remaining -= 1
                c.failures += 1
                left = self._inject_remaining
                raise TransferError(
                    f"injected failure writing {s.size} descriptor(s) to {peer} ({left} left)"
                )
        if s.size == 0:
            return
        try:
            self._check_sources(s, n)
        except TransferError:
            with c.lock:
                c.failures += 1
            raise

        src_l, dst_l, len_l = s.tolist(), d.tolist(), n.tolist()
        lane = self._acquire_lane(peer)
        try:
            engine, session, generation = lane.enter()
            try:
                failed = lane.write(engine, src_l, dst_l, len_l)
            finally:
                # Let go before a reopen, so its discard, not this frame, destroys the engine.
                del engine
                lane.leave()
            if failed is None:
                return
            lane.count(failures=1)
            what = f"write of {len(src_l)} descriptors from {session} to {peer}: {failed}"
            try:
                outcome = self._reopen_lane(lane, generation)
            except TransferError as exc:
                raise TransferError(f"{what}; replacing the lane to {peer} failed: {exc}") from exc
            raise TransferError(f"{what}; {outcome}; receive session {self._session_id} unchanged")
        finally:
            lane.unpin()

    async def write(
        self,
        peer: str,
        src: npt.NDArray[Any],
        dst: npt.NDArray[Any],
        length: npt.NDArray[Any],
    ) -> None:
        """Run ``write_sync`` on the bounded pool and resolve on the running loop.

        Cancelling the awaiting task does not stop a submit already on the wire.
        """
        loop = asyncio.get_running_loop()
        try:
            fut = loop.run_in_executor(self._pool, self.write_sync, peer, src, dst, length)
        except RuntimeError as exc:  # the pool refuses work once close() shut it down
            raise TransferError(f"MooncakeEngine is closed; write to {peer} not sent") from exc
        await fut

    def _check_sources(self, s: npt.NDArray[np.uint64], n: npt.NDArray[np.uint64]) -> None:
        # TCP reads any local address without checking it is registered; fail here instead.
        with self._guard:
            starts, ends = self._span_starts, self._span_ends
        if not starts.size:
            raise TransferError(f"no local memory registered; cannot send {s.size} descriptor(s)")
        idx = np.searchsorted(starts, s, side="right").astype(np.int64) - 1
        inside = idx >= 0
        inside[inside] = s[inside] + n[inside] <= ends[idx[inside]]
        if not inside.all():
            bad = np.flatnonzero(~inside)
            i = int(bad[0])
            raise TransferError(
                f"{bad.size} of {s.size} source range(s) are not within any locally registered "
                f"span; first is descriptor {i}: {int(s[i]):#x}+{int(n[i])}"
            )

    def close(self) -> None:
        """Stop the pool, close every lane, unregister every span and drop the receiving engine;
        idempotent."""
        with self._guard:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._admin_lock, self._guard:
            lanes = list(self._lanes.values())  # complete: no lane opens once _closed is set
        errors: list[TransferError] = []
        for lane in lanes:
            try:
                self._close_lane(lane)
            except TransferError as exc:
                errors.append(exc)
        with self._admin_lock:
            recv, self._recv = self._recv, None
            self._spans.clear()
            self._publish_spans()
        if recv is not None:
            recv.discard()
        if errors:
            raise errors[0]

    def __enter__(self) -> MooncakeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
