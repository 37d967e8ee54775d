"""KV pool client over the real Mooncake Store, with bounded waits and counters.

Mooncake Store facts (mooncake-transfer-engine-non-cuda 0.3.13.post1, loopback TCP, measured):

* ``setup(local_hostname, "P2PHANDSHAKE", global_segment_size, local_buffer_size, "tcp", "",
  "host:port")`` returns 0 in about 50 ms against a live master. The global segment is memory this
  client *contributes* to the pool (the objects live there; 0 contributes nothing); from 1 byte
  to 16 MiB setup fails with -600. With no master it retries for about 90 s (20 x 4.5 s) before
  returning -1 -- *holding the GIL* all along, so no thread-based timeout can interrupt it. The
  client therefore first checks that the master's port accepts a TCP connection and only then
  calls setup; a master dying in the ~50 ms between the two is the one wait this cannot bound.
* ``batch_is_exist`` gives 1 / 0 per key, a negative code on error. ``batch_put_from`` gives 0 per
  stored key (also for a key that already exists: the first object is kept), ``-200``
  (NO_AVAILABLE_HANDLE) for each key that found no room -- at once, nothing written for it.
  ``batch_get_into`` gives the object size per key, ``-704`` for a missing key, ``-600`` for a
  buffer too small, ``-707`` when the lease ran out after the bytes landed (asking again works).
  Empty batches return ``[]``. A small batch's round trip takes well under 1 ms here.
* A killed master: the next call fails at once with ``-900`` (RPC_FAIL) per key; later calls
  each block about 4.5 s (reconnect) and then give ``-900``. ``health_check`` still says 0 right
  after the kill (2, unreachable, a few seconds later). These data-path calls release the GIL,
  so the timeouts below do fire.
* ``close`` (and the store's destructor) *hold the GIL*: 1-2 s with a live master, 7-17 s of
  unmount retries with a dead one (mostly with the GIL released). ``close`` while another call on
  the same store is still running deadlocked the process (close waits for the call with the GIL
  held; the call needs the GIL to return), and two stores closing at once stalled every Python
  thread for seconds. Hence ``close`` here waits for the store to be idle and closes one store at
  a time, on a daemon thread.
* Exiting the interpreter while a Mooncake call still runs on a daemon thread crashed it
  (SIGSEGV / SIGABRT); after a master died, exit itself took 6-21 s (the store's teardown retries
  the dead master). ``quiesce`` before exit; ``os._exit`` is the way out when it returns False.
* Over TCP the buffers need not be registered (data is copied); registering keeps the zero-copy
  path for RDMA and costs nothing here.

* A get or put whose peer segment's holder is stopped (SIGSTOP) blocks; on SIGCONT it finishes
  and *succeeds*: a get writes its buffers seconds after the caller gave up. Stopped for 30 s,
  Mooncake's TCP transport drops the transfer and the get answers ``-800`` per key.

So every blocking call runs on a small bounded pool of *daemon* threads and is waited for with a
timeout: a call that runs past it is reported (counted, keys failed) and left to finish in the
background; the result's ``late`` is that call, and its buffers are not the caller's to reuse
until it is done (``quiesce`` waits for every call).
Outcomes, not exceptions, report pool trouble on the data
path: a full pool is back-pressure (counted, the rest of that request's puts not sent, nothing
raised); ``exists`` errors read as misses; a failed or timed-out ``get_into`` names the blocks to
recompute. ``PoolError`` is raised for set-up, registration and use of a client not started.
Counters count keys, except ``bytes_*`` (bytes) and ``timeouts`` and ``late_*`` (calls).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from app.errors import PoolError
from app.store.daemon_threads import DaemonExecutor
from app.store.pool_api import (
    INVALID_PARAMS,
    LEASE_EXPIRED,
    NO_AVAILABLE_HANDLE,
    OBJECT_ALREADY_EXISTS,
    OBJECT_NOT_FOUND,
    OK,
    GetResult,
    PoolConfig,
    PoolCounters,
    PutResult,
    StoreLike,
    mooncake_store_factory,
)

T = TypeVar("T")

_CLOSE_LOCK = threading.Lock()
"""One Mooncake store closes at a time in a process (see ``PoolClient._reap``)."""


@dataclass
class _Counters:
    lock: threading.Lock = field(default_factory=threading.Lock)
    values: dict[str, int] = field(default_factory=dict)

    def add(self, **deltas: int) -> None:
        with self.lock:
            for name, delta in deltas.items():
                self.values[name] = self.values.get(name, 0) + delta

    def snapshot(self) -> PoolCounters:
        with self.lock:
            return PoolCounters(**self.values)


class _CallTimeout(Exception):
    def __init__(self, late: concurrent.futures.Future[Any]) -> None:
        super().__init__("the pool call ran past its timeout")
        self.late = late


def _check_batch(keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> None:
    if not len(keys) == len(ptrs) == len(sizes):
        raise ValueError(
            f"keys, ptrs and sizes differ in length ({len(keys)}, {len(ptrs)}, {len(sizes)})"
        )
    if any(s <= 0 for s in sizes):
        raise ValueError("every size must be positive")


class PoolClient:
    """Batched exists / put / get against a Mooncake Store pool, every call under a timeout."""

    def __init__(
        self, config: PoolConfig, *, store_factory: Callable[[], StoreLike] | None = None
    ) -> None:
        self.config = config
        self._factory = store_factory or mooncake_store_factory
        self._store: StoreLike | None = None
        self._executor: DaemonExecutor | None = None
        self._last_executor: DaemonExecutor | None = None
        self._closed: threading.Event | None = None
        self._counters = _Counters()
        self._state_lock = threading.Lock()
        self._late: set[concurrent.futures.Future[Any]] = set()

    # ---------------------------------------------------------------- lifecycle

    @property
    def started(self) -> bool:
        """Whether ``start_async`` succeeded and ``close_async`` has not been called."""
        return self._store is not None

    def _setup_job(self) -> Callable[[], StoreLike]:
        cfg = self.config
        factory = self._factory

        def job() -> StoreLike:
            store = factory()
            rc = store.setup(
                cfg.local_hostname,
                cfg.metadata_server,
                cfg.global_segment_size,
                cfg.local_buffer_size,
                cfg.protocol,
                cfg.rdma_devices,
                cfg.master_address,
            )
            if rc != OK:
                hint = (
                    "invalid parameters (sizes, protocol, local_hostname)"
                    if rc == INVALID_PARAMS
                    else "is mooncake_master running there?"
                )
                raise PoolError(
                    f"Mooncake Store setup against master {cfg.master_address} failed "
                    f"(rc={rc}): {hint}"
                )
            return store

        return job

    def _probe_master(self) -> None:
        # setup() holds the GIL while it retries a missing master for ~90 s: fail fast instead.
        host, _, port = self.config.master_address.rpartition(":")
        try:
            with socket.create_connection(
                (host.strip("[]"), int(port)), timeout=min(self.config.setup_timeout_s, 3.0)
            ):
                pass
        except OSError as exc:
            raise PoolError(
                f"no Mooncake master reachable at {self.config.master_address} ({exc}); "
                "start mooncake_master there or fix master_address"
            ) from exc

    def _prepare_start(self) -> tuple[DaemonExecutor, concurrent.futures.Future[StoreLike]]:
        if self.config.protocol == "tcp":
            # The transfer engine picks RDMA whenever it finds an HCA; TCP was asked for.
            os.environ.setdefault("MC_FORCE_TCP", "1")
        executor = DaemonExecutor(self.config.max_workers, "kv-pool")
        return executor, executor.submit(self._setup_job())

    def _finish_start(self, executor: DaemonExecutor, store: StoreLike) -> None:
        with self._state_lock:
            self._executor = executor
            self._last_executor = executor
            self._store = store

    def _setup_timed_out(self, executor: DaemonExecutor) -> PoolError:
        executor.shutdown()
        return PoolError(
            f"Mooncake Store setup against master {self.config.master_address} did not finish "
            f"within {self.config.setup_timeout_s:.1f}s; is mooncake_master running there?"
        )

    async def start_async(self) -> None:
        """Join the pool (at most ``setup_timeout_s``)."""
        if self.started:
            return
        await asyncio.to_thread(self._probe_master)
        executor, fut = self._prepare_start()
        try:
            store = await asyncio.wait_for(
                asyncio.wrap_future(fut), timeout=self.config.setup_timeout_s
            )
        except TimeoutError:
            raise self._setup_timed_out(executor) from None
        except PoolError:
            executor.shutdown()
            raise
        except Exception as exc:
            executor.shutdown()
            raise PoolError(f"Mooncake Store setup failed: {exc}") from exc
        self._finish_start(executor, store)

    def _detach(self) -> tuple[StoreLike, DaemonExecutor] | None:
        with self._state_lock:
            store, executor = self._store, self._executor
            self._store = None
            self._executor = None
        if store is None or executor is None:
            return None
        return store, executor

    @staticmethod
    def _reap(detached: tuple[StoreLike, DaemonExecutor]) -> threading.Event:
        """Close the store on a daemon thread once no call on it runs; the event says done.

        Mooncake's ``close`` holds the GIL while it waits for calls still in flight on the same
        store, and those need the GIL to return: overlapping them deadlocked the process. Two
        stores closing at once stalled every Python thread for seconds. So: wait until the
        store is idle, close one store at a time process-wide, never on the caller's thread.
        """
        done = threading.Event()
        holder = [detached]

        def run() -> None:
            store, executor = holder.pop()
            try:
                executor.wait_idle(None)
                with _CLOSE_LOCK:
                    store.close()
                    del store  # the destructor runs here too, still one at a time
            except Exception:
                pass  # nothing left to report to: the client is gone
            finally:
                executor.shutdown()
                done.set()

        threading.Thread(target=run, name="kv-pool-close", daemon=True).start()
        return done

    async def close_async(self) -> None:
        """Leave the pool; waits at most ``close_timeout_s`` (a dead master makes close slow)."""
        detached = self._detach()
        if detached is None:
            return
        done = self._closed = self._reap(detached)
        del detached
        deadline = time.monotonic() + self.config.close_timeout_s
        while not done.is_set():
            if time.monotonic() >= deadline:
                self._counters.add(timeouts=1)
                return
            await asyncio.sleep(0.01)

    def counters(self) -> PoolCounters:
        """A snapshot of the counters."""
        snap = self._counters.snapshot()
        with self._state_lock:
            running = len(self._late)
        return dataclasses.replace(snap, late_running=running)

    def quiesce(self, timeout_s: float) -> bool:
        """Wait until no call -- not a timed-out one, not the close -- still runs; True if so.

        Call it before reusing buffers a timed-out get may still write, and before the process
        exits: a Mooncake call still running while the interpreter shuts down can crash it.
        """
        deadline = time.monotonic() + timeout_s
        executor = self._last_executor
        if executor is not None and not executor.wait_idle(timeout_s):
            return False
        closed = self._closed
        return closed is None or closed.wait(max(0.0, deadline - time.monotonic()))

    # ---------------------------------------------------------------- plumbing

    def _live(self) -> StoreLike:
        store = self._store
        if store is None:
            raise PoolError(
                "the pool client is not started (call start_async() first) or was closed"
            )
        return store

    def _submit(self, job: Callable[[], T]) -> concurrent.futures.Future[T]:
        # Under the state lock: once close() has detached the store, nothing new may reach it.
        with self._state_lock:
            if self._executor is None:
                raise PoolError("the pool client was closed")
            return self._executor.submit(job)

    async def _call_async(self, job: Callable[[], T], timeout_s: float) -> T:
        fut = self._submit(job)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout=timeout_s)
        except TimeoutError:
            # A queued call is cancelled and never reaches the store; a running one cannot be.
            if not fut.cancel():
                self._track_late(fut)
            raise _CallTimeout(fut) from None

    def _track_late(self, fut: concurrent.futures.Future[Any]) -> None:
        with self._state_lock:
            self._late.add(fut)

        def returned(done: concurrent.futures.Future[Any]) -> None:
            with self._state_lock:
                self._late.discard(done)
            self._counters.add(late_returns=1)

        fut.add_done_callback(returned)  # at once if it already returned

    # ---------------------------------------------------------------- register

    def _register_job(self, store: StoreLike, ptr: int, length: int) -> Callable[[], int]:
        return lambda: store.register_buffer(ptr, length)

    def _register_done(self, rc: int, ptr: int, length: int) -> None:
        if rc != OK:
            raise PoolError(f"register_buffer({ptr:#x}, {length}) failed (rc={rc})")

    async def register_async(self, ptr: int, length: int) -> None:
        """Register a buffer that puts read from and gets write into."""
        if ptr <= 0 or length <= 0:
            raise ValueError("ptr and length must be positive")
        store = self._live()
        try:
            rc = await self._call_async(
                self._register_job(store, ptr, length), self.config.timeout_s
            )
        except _CallTimeout:
            self._counters.add(timeouts=1, failures=1)
            raise PoolError(
                f"register_buffer timed out after {self.config.timeout_s:.1f}s"
            ) from None
        self._register_done(rc, ptr, length)

    # ---------------------------------------------------------------- exists

    def _exists_done(self, codes: Sequence[int] | None, n: int) -> list[bool]:
        if codes is None or len(codes) != n:
            self._counters.add(failures=n)
            return [False] * n
        present = [c == 1 for c in codes]
        errors = sum(1 for c in codes if c < 0)
        hits = sum(present)
        self._counters.add(hits=hits, misses=n - hits - errors, failures=errors)
        return present

    async def exists_async(self, keys: Sequence[str]) -> list[bool]:
        """Which keys the pool holds, in one batched call; errors and timeouts read as absent."""
        if not keys:
            return []
        store = self._live()
        key_list = list(keys)
        try:
            codes = await self._call_async(
                lambda: store.batch_is_exist(key_list), self.config.timeout_s
            )
        except _CallTimeout:
            self._counters.add(timeouts=1)
            codes = None
        except Exception:
            codes = None
        return self._exists_done(codes, len(key_list))

    # ---------------------------------------------------------------- put

    def _put_job(
        self, store: StoreLike, keys: list[str], ptrs: list[int], sizes: list[int], deadline: float
    ) -> Callable[[], PutResult]:
        max_batch = self.config.max_batch_keys

        def job() -> PutResult:
            n = len(keys)
            codes = store.batch_is_exist(keys)
            if len(codes) != n:
                codes = [0] * n
            # An exists error (negative) says nothing either way: try the put.
            skipped = [i for i in range(n) if codes[i] == 1]
            todo = [i for i in range(n) if codes[i] != 1]
            stored: list[int] = []
            backpressure: list[int] = []
            failed: list[int] = []
            full = False
            for start in range(0, len(todo), max_batch):
                chunk = todo[start : start + max_batch]
                if full or time.monotonic() > deadline:
                    # Pool full (or the caller gave up): the rest of this request is not sent.
                    (backpressure if full else failed).extend(chunk)
                    continue
                rcs = store.batch_put_from(
                    [keys[i] for i in chunk], [ptrs[i] for i in chunk], [sizes[i] for i in chunk]
                )
                if len(rcs) != len(chunk):
                    failed.extend(chunk)
                    continue
                for i, rc in zip(chunk, rcs, strict=True):
                    if rc == OK:
                        stored.append(i)
                    elif rc == OBJECT_ALREADY_EXISTS:
                        skipped.append(i)
                    elif rc == NO_AVAILABLE_HANDLE:
                        backpressure.append(i)
                        full = True
                    else:
                        failed.append(i)
            return PutResult(
                stored=tuple(stored),
                skipped=tuple(sorted(skipped)),
                backpressure=tuple(backpressure),
                failed=tuple(failed),
                bytes_put=sum(sizes[i] for i in stored),
            )

        return job

    def _put_done(
        self,
        result: PutResult | None,
        n: int,
        timed_out: bool,
        late: concurrent.futures.Future[Any] | None = None,
    ) -> PutResult:
        if result is None:
            result = PutResult(failed=tuple(range(n)), timed_out=timed_out, late=_running(late))
        self._counters.add(
            keys_put=len(result.stored),
            keys_skipped=len(result.skipped),
            bytes_put=result.bytes_put,
            backpressure=len(result.backpressure),
            failures=len(result.failed),
            timeouts=1 if timed_out else 0,
        )
        return result

    async def put_from_async(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> PutResult:
        """Store blocks from memory; keys already pooled are skipped, a full pool is reported."""
        _check_batch(keys, ptrs, sizes)
        if not keys:
            return PutResult()
        store = self._live()
        timeout = self.config.timeout_s
        job = self._put_job(store, list(keys), list(ptrs), list(sizes), time.monotonic() + timeout)
        try:
            result = await self._call_async(job, timeout)
        except _CallTimeout as t:
            return self._put_done(None, len(keys), True, t.late)
        except Exception:
            return self._put_done(None, len(keys), False)
        return self._put_done(result, len(keys), False)

    # ---------------------------------------------------------------- get

    def _get_job(
        self, store: StoreLike, keys: list[str], ptrs: list[int], sizes: list[int]
    ) -> Callable[[], list[int]]:
        def job() -> list[int]:
            codes = list(store.batch_get_into(keys, ptrs, sizes))
            retry = [i for i, c in enumerate(codes) if c == LEASE_EXPIRED]
            if retry and len(codes) == len(keys):
                # The bytes landed but the lease check failed; a second get takes a new lease.
                again = store.batch_get_into(
                    [keys[i] for i in retry], [ptrs[i] for i in retry], [sizes[i] for i in retry]
                )
                for i, c in zip(retry, again, strict=False):
                    codes[i] = c
            return codes

        return job

    def _get_done(
        self,
        codes: Sequence[int] | None,
        sizes: Sequence[int],
        timed_out: bool,
        late: concurrent.futures.Future[Any] | None = None,
    ) -> GetResult:
        n = len(sizes)
        if codes is None or len(codes) != n:
            self._counters.add(failures=n, timeouts=1 if timed_out else 0)
            return GetResult(failed=tuple(range(n)), timed_out=timed_out, late=_running(late))
        # A short read is as useless as none: the block must be recomputed.
        loaded = tuple(i for i, c in enumerate(codes) if c == sizes[i])
        failed = tuple(i for i, c in enumerate(codes) if c != sizes[i])
        not_found = sum(1 for c in codes if c == OBJECT_NOT_FOUND)
        got = sum(sizes[i] for i in loaded)
        self._counters.add(
            keys_got=len(loaded),
            bytes_got=got,
            misses=not_found,
            failures=len(failed) - not_found,
        )
        return GetResult(loaded=loaded, failed=failed, codes=tuple(codes), bytes_got=got)

    async def get_into_async(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> GetResult:
        """Load blocks into memory; failed ones are reported by index for recompute."""
        _check_batch(keys, ptrs, sizes)
        if not keys:
            return GetResult()
        store = self._live()
        job = self._get_job(store, list(keys), list(ptrs), list(sizes))
        try:
            codes = await self._call_async(job, self.config.timeout_s)
        except _CallTimeout as t:
            return self._get_done(None, sizes, True, t.late)
        except Exception:
            return self._get_done(None, sizes, False)
        return self._get_done(codes, sizes, False)

    # ---------------------------------------------------------------- other calls

    async def run_async(self, call: Callable[[StoreLike], T]) -> T | None:
        """``call(store)`` on the pool's threads under the call timeout; None when it failed
        or ran past it (counted), for calls whose failure only leaves something unchecked."""
        store = self._live()
        try:
            return await self._call_async(lambda: call(store), self.config.timeout_s)
        except _CallTimeout:
            self._counters.add(timeouts=1)
        except Exception:
            self._counters.add(failures=1)
        return None


def _running(fut: concurrent.futures.Future[Any] | None) -> concurrent.futures.Future[Any] | None:
    """``fut`` if the store may still be running it (a cancelled one never started)."""
    return None if fut is None or fut.cancelled() else fut
