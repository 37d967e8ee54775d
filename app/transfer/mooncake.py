"""A thread-safe wrapper over the real Mooncake ``TransferEngine`` (DESIGN §6).

Two ways to wait for a write (``EngineConfig.wait``):

- ``poll`` (default): every descriptor is its own ``transfer_submit_write``, at most
  ``max_descriptors_per_submit`` in flight per call, and the caller polls
  ``transfer_check_status`` with short sleeps. The engine's batch calls busy-spin the waiting
  thread until the whole batch lands, which on a small host takes the core the TCP sender and
  receiver need: on this 2-core machine polling moved 256 KiB descriptors ~8% faster at less than
  half the CPU, and 4-16 KiB ones at the same rate for half the CPU.
- ``spin``: ``batch_transfer_sync_write`` chunks of at most ``max_descriptors_per_submit``.

Any failed write replaces the local engine (new ``TransferEngine``, ``initialize`` again, every
remembered span registered again, the old engine's spans unregistered), which changes
``session_id`` and bumps ``generation``.

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
- Destroying a ``TransferEngine`` takes ~1 s and holds the GIL throughout, so a reopen stalls
  every Python thread, the event loop included, for about a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from app.errors import ConfigError, TransferError

__all__ = ["EngineConfig", "MooncakeEngine"]

# Descriptors in flight to one peer that the TCP lane accepted here; more poisons the session.
_LANE_QUEUE_LIMIT = 2048
# Bounds how long a reopen waits for other threads' writes on the old engine; one chunk is
# itself bounded by the engine's 30 s progress timeout.
_DRAIN_TIMEOUT_S = 120.0
_OK = 0
# transfer_check_status: 1 landed (the engine freed the id), 0 still going, -1 failed, -2 timed out.
_LANDED, _GOING = 1, 0
# transfer_submit_write returns -1 as an unsigned id when it refuses; this wheel returned 0.
_REFUSED_IDS = frozenset({0, (1 << 64) - 1})
# A polled write gives up like the engine's own sync calls: 30 s plus 1 s per GiB.
_POLL_GRACE_S = 30.0
_POLL_MIN_RATE = float(1 << 30)
# Sleeps between polls double from the first to the cap while nothing lands: a landing is seen
# at most ~0.2 ms late, and a write of milliseconds costs a few dozen wake-ups.
_POLL_FIRST_S, _POLL_CAP_S = 20e-6, 200e-6

Wait = Literal["poll", "spin"]


@dataclass(frozen=True)
class EngineConfig:
    """How to start the local engine and how to cut writes into submits."""

    host: str = "127.0.0.1"
    protocol: str = "tcp"  # "tcp" or "rdma"
    device_name: str = ""
    # Per call: descriptors in flight (poll) or in one batch (spin). DESIGN §6: 4096 poisoned
    # the session, 2048 passed.
    max_descriptors_per_submit: int = 1024
    spin_threads: int = 2  # bounded pool that runs write() calls
    force_tcp: bool = True  # sets MC_FORCE_TCP=1 before initialize when protocol == "tcp"
    wait: Wait = "poll"

    def __post_init__(self) -> None:
        if self.protocol not in ("tcp", "rdma"):
            raise ConfigError(
                f"EngineConfig.protocol must be 'tcp' or 'rdma', got {self.protocol!r}"
            )
        if not 1 <= self.max_descriptors_per_submit <= _LANE_QUEUE_LIMIT:
            raise ConfigError(
                f"EngineConfig.max_descriptors_per_submit must be in 1..{_LANE_QUEUE_LIMIT} "
                f"(larger batches poison the session), got {self.max_descriptors_per_submit}"
            )
        if self.spin_threads < 1:
            raise ConfigError(f"EngineConfig.spin_threads must be >= 1, got {self.spin_threads}")
        if self.wait not in ("poll", "spin"):
            raise ConfigError(f"EngineConfig.wait must be 'poll' or 'spin', got {self.wait!r}")


def _import_engine_class() -> Any:
    try:
        from mooncake.engine import TransferEngine
    except (ImportError, OSError) as exc:
        raise TransferError(
            "mooncake.engine could not be imported "
            f"({type(exc).__name__}: {exc}); install the 'mooncake' extra "
            "(mooncake-transfer-engine-non-cuda) and Debian's libibverbs1 librdmacm1 libnuma1"
        ) from exc
    return TransferEngine


def _as_u64(name: str, arr: Any) -> npt.NDArray[np.uint64]:
    a = np.asarray(arr)
    if a.ndim != 1:
        raise TransferError(f"{name} must be a 1-D array, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise TransferError(f"{name} must hold integers, got dtype {a.dtype}")
    if a.size and a.dtype.kind == "i" and int(a.min()) < 0:
        raise TransferError(f"{name} must not hold negative values, got min {int(a.min())}")
    return a.astype(np.uint64, copy=False)


class MooncakeEngine:
    """One local Mooncake ``TransferEngine`` plus the registrations and recovery around it.

    Counters: ``submits`` counts submissions the engine accepted or refused (a batch per chunk
    when spinning, one per descriptor when polling), ``descriptors`` and ``bytes`` what the
    engine confirmed written, ``failures`` write calls that raised (injected ones included),
    ``reopens`` engine replacements.
    """

    def __init__(self, config: EngineConfig = EngineConfig()) -> None:
        self._config = config
        self._engine_cls = _import_engine_class()
        if config.protocol == "tcp" and config.force_tcp:
            # The engine picks RDMA whenever it finds an HCA unless told otherwise.
            os.environ["MC_FORCE_TCP"] = "1"

        # Serialises everything that changes the engine or the registrations.
        self._admin_lock = threading.Lock()
        # Guards the engine reference, the writers using it and the per-peer in-flight budget.
        self._cond = threading.Condition()
        self._stats_lock = threading.Lock()

        self._spans: dict[int, int] = {}
        # Sorted copies of the spans for the per-write source check; swapped under _cond.
        self._span_starts = np.empty(0, dtype=np.uint64)
        self._span_ends = np.empty(0, dtype=np.uint64)
        self._active_writers = 0
        self._reopening = False
        self._inflight: dict[str, int] = {}
        self._closed = False
        self._generation = 0
        self._inject_remaining = 0
        self._submits = 0
        self._descriptors = 0
        self._bytes = 0
        self._failures = 0
        self._reopens = 0

        self._engine, self._session_id = self._start_engine()
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
        """``host:rpc_port`` of the current local engine; changes on every reopen."""
        with self._cond:
            return self._session_id

    @property
    def generation(self) -> int:
        """How many times the local engine has been replaced since construction."""
        with self._cond:
            return self._generation

    @property
    def spans(self) -> list[tuple[int, int]]:
        """Every remembered registration as ``(ptr, length)``, in address order."""
        with self._admin_lock:
            return sorted(self._spans.items())

    @property
    def submits(self) -> int:
        """Submissions made to the engine, failed ones included."""
        with self._stats_lock:
            return self._submits

    @property
    def descriptors(self) -> int:
        """Descriptors confirmed written."""
        with self._stats_lock:
            return self._descriptors

    @property
    def bytes(self) -> int:
        """Bytes confirmed written."""
        with self._stats_lock:
            return self._bytes

    @property
    def failures(self) -> int:
        """Write calls that raised, injected failures included."""
        with self._stats_lock:
            return self._failures

    @property
    def reopens(self) -> int:
        """Times the local engine was replaced after a failed submit."""
        with self._stats_lock:
            return self._reopens

    def counters(self) -> dict[str, int]:
        """All counters taken at one instant."""
        with self._stats_lock:
            return {
                "submits": self._submits,
                "descriptors": self._descriptors,
                "bytes": self._bytes,
                "failures": self._failures,
                "reopens": self._reopens,
            }

    # ------------------------------------------------------------------ registration

    def register(self, ptr: int, length: int) -> None:
        """Register ``[ptr, ptr + length)`` with the engine and remember it for reopens."""
        self.register_many([(ptr, length)])

    def register_many(self, spans: Sequence[tuple[int, int]]) -> None:
        """Register several spans in one engine call; all or none are remembered."""
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
            with self._cond:
                engine = self._engine
            self._register_on(engine, items)
            self._spans.update(items)
            self._publish_spans()

    def unregister_all(self) -> None:
        """Unregister every remembered span from the current engine and forget them."""
        with self._admin_lock:
            with self._cond:
                engine = self._engine
            ptrs = list(self._spans)
            self._spans.clear()
            self._publish_spans()
            if engine is not None:
                self._unregister_on(engine, ptrs)

    def _publish_spans(self) -> None:
        items = sorted(self._spans.items())
        starts = np.array([p for p, _ in items], dtype=np.uint64)
        ends = np.array([p + n for p, n in items], dtype=np.uint64)
        with self._cond:
            self._span_starts, self._span_ends = starts, ends

    def _register_on(self, engine: Any, items: Sequence[tuple[int, int]]) -> None:
        rc = engine.batch_register_memory([p for p, _ in items], [n for _, n in items])
        if rc != _OK:
            # The batch may have registered a prefix; drop it so the engine matches our list.
            for p, _ in items:
                engine.unregister_memory(p)
            raise TransferError(
                f"batch_register_memory of {len(items)} span(s) returned {rc}, expected 0 "
                f"(first span {items[0][0]:#x}+{items[0][1]})"
            )

    @staticmethod
    def _unregister_on(engine: Any, ptrs: Sequence[int]) -> None:
        bad = [(p, rc) for p in ptrs if (rc := engine.unregister_memory(p)) != _OK]
        if bad:
            p, rc = bad[0]
            raise TransferError(
                f"unregister_memory failed for {len(bad)} of {len(ptrs)} span(s): "
                f"{p:#x} returned {rc}, expected 0"
            )

    # ------------------------------------------------------------------------ writes

    def inject_failures(self, n: int) -> None:
        """Make the next ``n`` write calls raise TransferError before touching the wire."""
        if n < 0:
            raise TransferError(f"inject_failures needs n >= 0, got {n}")
        with self._stats_lock:
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
        time. A failed write replaces the local engine (see the module docstring), then raises
        TransferError saying how many descriptors landed before the failure; later ones may or
        may not have. Every failure costs a reopen (~1 s with the GIL held), so stop writing to a
        peer that keeps failing.
        """
        with self._cond:
            self._check_open()
        s, d, n = _as_u64("src", src), _as_u64("dst", dst), _as_u64("length", length)
        if not s.size == d.size == n.size:
            raise TransferError(
                f"src, dst and length must have equal sizes, got {s.size}, {d.size}, {n.size}"
            )
        with self._stats_lock:
            if self._inject_remaining > 0:
                self._inject_remaining -= 1
                self._failures += 1
                left = self._inject_remaining
                raise TransferError(
                    f"injected failure writing {s.size} descriptor(s) to {peer} ({left} left)"
                )
        if s.size == 0:
            return
        try:
            self._check_sources(s, n)
        except TransferError:
            self._count(failures=1)
            raise

        src_l, dst_l, len_l = s.tolist(), d.tolist(), n.tolist()
        write = self._write_polled if self._config.wait == "poll" else self._write_batches
        engine, generation, session = self._enter_writer()
        try:
            failed = write(engine, peer, src_l, dst_l, len_l)
        finally:
            self._leave_writer()
        if failed is None:
            return
        self._count(failures=1)
        what = f"write of {len(src_l)} descriptors from {session} to {peer}: {failed}"
        try:
            self._reopen(generation)
        except TransferError as exc:
            raise TransferError(f"{what}; replacing the local engine failed too: {exc}") from exc
        raise TransferError(
            f"{what}; local engine replaced, now {self.session_id} (generation {self.generation})"
        )

    def _write_batches(
        self, engine: Any, peer: str, src: list[int], dst: list[int], length: list[int]
    ) -> str | None:
        """``spin``: sync batch calls of at most ``max_descriptors_per_submit``; None if all
        landed, else what failed."""
        total = len(src)
        step = self._config.max_descriptors_per_submit
        for start in range(0, total, step):
            end = min(start + step, total)
            nbytes = sum(length[start:end])
            self._take_budget(peer, end - start)
            try:
                rc = engine.batch_transfer_sync_write(
                    peer, src[start:end], dst[start:end], length[start:end]
                )
            finally:
                self._return_budget(peer, end - start)
            self._count(submits=1, landed=end - start if rc == _OK else 0, nbytes=nbytes)
            if rc != _OK:
                return (
                    f"batch_transfer_sync_write returned {rc}, expected 0, for descriptors "
                    f"{start}..{end - 1} ({end - start} descriptors, {nbytes} bytes; "
                    f"{start} landed before)"
                )
        return None

    def _write_polled(
        self, engine: Any, peer: str, src: list[int], dst: list[int], length: list[int]
    ) -> str | None:
        """``poll``: one transfer per descriptor, a sliding window of them in flight, landings
        polled oldest first; None if all landed, else what failed."""
        total = len(src)
        window = self._config.max_descriptors_per_submit
        t0 = time.monotonic()
        deadline = t0 + _POLL_GRACE_S + sum(length) / _POLL_MIN_RATE
        pending: deque[int] = deque()  # transfer ids of descriptors landed..sent-1
        landed = sent = 0
        pause = _POLL_FIRST_S
        try:
            while landed < total:
                if sent < total and len(pending) < window:
                    k = min(window - len(pending), total - sent)
                    self._take_budget(peer, k)
                    for i in range(sent, sent + k):
                        tid = engine.transfer_submit_write(peer, src[i], dst[i], length[i])
                        if tid in _REFUSED_IDS:
                            self._return_budget(peer, sent + k - i)
                            self._count(submits=i - sent + 1)
                            return (
                                f"transfer_submit_write refused descriptor {i} ({length[i]} "
                                f"bytes; {landed} landed before)"
                            )
                        pending.append(tid)
                    sent += k
                    self._count(submits=k)
                done = nbytes = 0
                while pending:
                    rc = engine.transfer_check_status(pending[0])
                    if rc == _GOING:
                        break
                    if rc != _LANDED:
                        i = landed + done
                        self._finish_polled(peer, done, nbytes)
                        return (
                            f"transfer_check_status returned {rc}, expected 1, for descriptor "
                            f"{i} ({length[i]} bytes; {i} landed before)"
                        )
                    pending.popleft()
                    nbytes += length[landed + done]
                    done += 1
                if done:
                    landed += done
                    self._finish_polled(peer, done, nbytes)
                    pause = _POLL_FIRST_S
                elif time.monotonic() > deadline:
                    return (
                        f"descriptor {landed} ({length[landed]} bytes) had not landed "
                        f"{time.monotonic() - t0:.0f} s after the write began; {landed} landed "
                        "before"
                    )
                else:
                    time.sleep(pause)
                    pause = min(2 * pause, _POLL_CAP_S)
            return None
        finally:
            # Failed or abandoned transfers no longer count against the peer's lane: the
            # engine that holds them is replaced before the failure is raised.
            if pending:
                self._return_budget(peer, len(pending))

    def _finish_polled(self, peer: str, landed: int, nbytes: int) -> None:
        if landed:
            self._return_budget(peer, landed)
            self._count(landed=landed, nbytes=nbytes)

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

    def _count(
        self, *, submits: int = 0, landed: int = 0, nbytes: int = 0, failures: int = 0
    ) -> None:
        with self._stats_lock:
            self._submits += submits
            self._failures += failures
            if landed:
                self._descriptors += landed
                self._bytes += nbytes

    def _check_sources(self, s: npt.NDArray[np.uint64], n: npt.NDArray[np.uint64]) -> None:
        # TCP reads any local address without checking it is registered; fail here instead.
        with self._cond:
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

    # ------------------------------------------------------- engine lifetime & budget

    def _start_engine(self) -> tuple[Any, str]:
        cfg = self._config
        engine = self._engine_cls()
        rc = engine.initialize(cfg.host, "P2PHANDSHAKE", cfg.protocol, cfg.device_name)
        if rc != _OK:
            raise TransferError(
                f"TransferEngine.initialize({cfg.host!r}, 'P2PHANDSHAKE', {cfg.protocol!r}, "
                f"{cfg.device_name!r}) returned {rc}, expected 0"
            )
        return engine, f"{cfg.host}:{engine.get_rpc_port()}"

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("MooncakeEngine is closed")

    def _enter_writer(self) -> tuple[Any, int, str]:
        with self._cond:
            # A reopen in progress would hand us an engine about to be destroyed.
            if not self._cond.wait_for(lambda: not self._reopening, timeout=_DRAIN_TIMEOUT_S):
                raise TransferError(
                    f"engine reopen did not finish within {_DRAIN_TIMEOUT_S:.0f} s; write not sent"
                )
            self._check_open()
            self._active_writers += 1
            return self._engine, self._generation, self._session_id

    def _leave_writer(self) -> None:
        with self._cond:
            self._active_writers -= 1
            self._cond.notify_all()

    def _take_budget(self, peer: str, k: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._inflight.get(peer, 0) + k <= _LANE_QUEUE_LIMIT)
            self._inflight[peer] = self._inflight.get(peer, 0) + k

    def _return_budget(self, peer: str, k: int) -> None:
        with self._cond:
            left = self._inflight[peer] - k
            if left:
                self._inflight[peer] = left
            else:
                del self._inflight[peer]
            self._cond.notify_all()

    def _reopen(self, failed_generation: int) -> None:
        """Replace the local engine unless another thread already did since the failure."""
        with self._admin_lock:
            with self._cond:
                if self._closed or self._generation != failed_generation:
                    return
                self._reopening = True
            try:
                new_engine, new_session = self._start_engine()
                try:
                    # Register before draining so the swap itself is quick.
                    self._register_on(new_engine, sorted(self._spans.items()))
                    with self._cond:
                        if not self._cond.wait_for(
                            lambda: self._active_writers == 0, timeout=_DRAIN_TIMEOUT_S
                        ):
                            raise TransferError(
                                f"{self._active_writers} write(s) still running on the old "
                                f"engine after {_DRAIN_TIMEOUT_S:.0f} s; old engine kept"
                            )
                        old = self._engine
                        self._engine, self._session_id = new_engine, new_session
                        self._generation += 1
                except BaseException:
                    # Keep the original error; the spans may not all be registered there.
                    with contextlib.suppress(TransferError):
                        self._discard(new_engine, list(self._spans))
                    raise
            finally:
                with self._cond:
                    self._reopening = False
                    self._cond.notify_all()
            with self._stats_lock:
                self._reopens += 1
            self._discard(old, list(self._spans))

    def _discard(self, engine: Any, ptrs: list[int]) -> None:
        # Leaves none of our memory registered with an engine we drop. Its destructor then
        # takes ~1 s with the GIL held: better now than at some later garbage collection.
        try:
            self._unregister_on(engine, ptrs)
        finally:
            del engine

    def close(self) -> None:
        """Stop the pool, unregister every span and drop the engine; idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._admin_lock:
            with self._cond:
                self._cond.wait_for(lambda: self._active_writers == 0, timeout=_DRAIN_TIMEOUT_S)
                engine, self._engine = self._engine, None
            ptrs = list(self._spans)
            self._spans.clear()
            self._publish_spans()
            if engine is not None:
                self._discard(engine, ptrs)

    def __enter__(self) -> MooncakeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
