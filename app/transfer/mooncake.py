"""A thread-safe wrapper over the real Mooncake ``TransferEngine`` (DESIGN §6).

Writes go out as ``batch_transfer_sync_write`` chunks of at most
``max_descriptors_per_submit`` descriptors, on a small bounded thread pool because the sync
calls busy-spin a core. Any failed submit replaces the local engine (new ``TransferEngine``,
``initialize`` again, every remembered span registered again, the old engine's spans
unregistered), which changes ``session_id`` and bumps ``generation``.

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
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class EngineConfig:
    """How to start the local engine and how to cut writes into submits."""

    host: str = "127.0.0.1"
    protocol: str = "tcp"  # "tcp" or "rdma"
    device_name: str = ""
    max_descriptors_per_submit: int = 1024  # DESIGN §6: 4096 poisoned the session, 2048 passed
    spin_threads: int = 2  # bounded pool for the busy-spinning sync calls
    force_tcp: bool = True  # sets MC_FORCE_TCP=1 before initialize when protocol == "tcp"

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

    Counters: ``submits`` counts batch calls made to the engine (failed ones included),
    ``descriptors`` and ``bytes`` what those calls confirmed written, ``failures`` write
    calls that raised (injected ones included), ``reopens`` engine replacements.
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
        """Batch calls made to the engine, failed ones included."""
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

        Submits in chunks of ``max_descriptors_per_submit``. A failed submit replaces the local
        engine (see the module docstring), then raises TransferError; chunks before the failed
        one have landed, later ones were not sent. Every failed submit costs a reopen (~1 s
        with the GIL held), so stop writing to a peer that keeps failing.
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
            self._count_failure()
            raise

        src_l, dst_l, len_l = s.tolist(), d.tolist(), n.tolist()
        total = len(src_l)
        step = self._config.max_descriptors_per_submit
        engine, generation, session = self._enter_writer()
        failed: tuple[int, int, int, int] | None = None  # (rc, start, end, bytes)
        try:
            for start in range(0, total, step):
                end = min(start + step, total)
                nbytes = sum(len_l[start:end])
                self._take_budget(peer, end - start)
                try:
                    # Sync rather than batch_transfer_async_write + get_batch_transfer_status:
                    # both released the GIL and busy-spun ~1.5 cores at the same 0.7-1.5 GB/s
                    # here (within noise, pipelined or not), but the sync call frees its batch
                    # on every path, and pipelining async chunks would put 2 x 1024 descriptors
                    # in flight, the queue-full edge.
                    rc = engine.batch_transfer_sync_write(
                        peer, src_l[start:end], dst_l[start:end], len_l[start:end]
                    )
                finally:
                    self._return_budget(peer, end - start)
                with self._stats_lock:
                    self._submits += 1
                    if rc == _OK:
                        self._descriptors += end - start
                        self._bytes += nbytes
                if rc != _OK:
                    failed = (rc, start, end, nbytes)
                    break
        finally:
            self._leave_writer()

        if failed is None:
            return
        self._count_failure()
        rc, start, end, nbytes = failed
        what = (
            f"batch_transfer_sync_write from {session} to {peer} returned {rc}, expected 0, "
            f"for descriptors {start}..{end - 1} of {total} ({end - start} descriptors, "
            f"{nbytes} bytes; {start} landed before)"
        )
        try:
            self._reopen(generation)
        except TransferError as exc:
            raise TransferError(f"{what}; replacing the local engine failed too: {exc}") from exc
        raise TransferError(
            f"{what}; local engine replaced, now {self.session_id} (generation {self.generation})"
        )

    async def write(
        self,
        peer: str,
        src: npt.NDArray[Any],
        dst: npt.NDArray[Any],
        length: npt.NDArray[Any],
    ) -> None:
        """Run ``write_sync`` on the bounded spin pool and resolve on the running loop.

        Cancelling the awaiting task does not stop a submit already on the wire.
        """
        loop = asyncio.get_running_loop()
        try:
            fut = loop.run_in_executor(self._pool, self.write_sync, peer, src, dst, length)
        except RuntimeError as exc:  # the pool refuses work once close() shut it down
            raise TransferError(f"MooncakeEngine is closed; write to {peer} not sent") from exc
        await fut

    def _count_failure(self) -> None:
        with self._stats_lock:
            self._failures += 1

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
