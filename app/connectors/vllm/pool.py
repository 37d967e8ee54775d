"""A rank's KV pool loads and stores, off the forward path.

One thread with its own engine link (a ZMQ socket belongs to one thread): a load or a store
takes as long as Mooncake Store needs, and the engine only learns the outcome from
``get_finished`` like any other asynchronous transfer.

A load or save the sidecar answers *pending* (its Mooncake call ran past the pool's timeout
and still writes or reads the request's blocks), or that the link gave up on (the sidecar may
have begun it), is reported to vLLM only once a poll finds it settled: until then the request
waits (load) or keeps its blocks (save), so vLLM reuses no block the store may still touch. The
polls go out on this thread between jobs, one at a time, at most every ``POLL_INTERVAL_S``: a
late call holds its own request, never the loads queued behind it.

A running request's store (issue 54, ``pool_requests``) skips what the request's earlier stores
stored. One of them that failed on this rank (an error, keys refused or failed) would leave a
hole every later store skips, and the pool would keep blocks no hit can reach: so this rank's
later stores of the request start from that store's own floor again (``_floors``), until one of
them succeeded. The jobs of a rank run in order on one thread, so the next store sees the
outcome; on a device it first waits for the step's forward pass (``ready``), whose KV it reads.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from app.connectors.vllm.config import ConnectorConfig
from app.connectors.vllm.metadata import PoolJob
from app.devices import Event
from app.engine_link.client import EngineLink
from app.errors import DeadlineExceeded, KVSidecarError, SidecarGone

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.05
# Requests whose failed running store this rank remembers: a request that ends without its
# store at the end (nothing left to store) leaves its entry, so the oldest go past this many.
MAX_FLOORS = 4096
_RUNNING = "@pool-"


def running_save_id(req_id: str, tokens: int) -> str:
    """The id a running request's store of its first ``tokens`` tokens goes by."""
    return f"{req_id}{_RUNNING}{tokens}"


def request_of(save_id: str) -> str:
    """The request a store's id names (a running store's, or the request's own)."""
    return save_id.rsplit(_RUNNING, 1)[0]


class PoolJobs:
    def __init__(self, config: ConnectorConfig, rank: int) -> None:
        self.link = EngineLink(
            config.sidecar, config.engine_id, rank, timeout_s=config.link_timeout_s
        )
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kvs-pool-{rank}")
        self._lock = threading.Lock()
        self._loaded: set[str] = set()
        self._saved: set[str] = set()
        self._failed: set[str] = set()
        # Calls whose store call may still run: reported once a poll finds them settled.
        self._late_loads: set[str] = set()
        self._late_saves: set[str] = set()
        # Stores of running requests (by save id): they end through ``take_running``.
        self._running: set[str] = set()
        self._running_done: set[str] = set()
        # Request -> the tokens its stores on this rank are known to have stored: set by a
        # failed running store, cleared by the next one that succeeded (module docstring).
        # Touched on the pool thread only.
        self._floors: dict[str, int] = {}
        self._polling = False
        self._polled_at = 0.0

    def load(self, job: PoolJob) -> None:
        self._thread.submit(self._load, job)

    def save(self, job: PoolJob, ready: Event | None = None) -> None:
        """Queue a store; ``ready``: the device event after which its blocks hold their KV."""
        if job.running:
            with self._lock:
                self._running.add(job.req_id)
        self._thread.submit(self._save, job, ready)

    def take_running(self) -> set[str]:
        """Running requests' stores (save ids) that ended since the last call."""
        with self._lock:
            out, self._running_done = self._running_done, set()
            return out

    def _ended(self, sid: str) -> None:
        """A store ended (under the lock)."""
        if sid in self._running:
            self._running.discard(sid)
            self._running_done.add(sid)
        else:
            self._saved.add(sid)

    def drain(self) -> tuple[set[str], set[str], set[str]]:
        """Requests loaded, stored, and failed to load (whole or in part) since the last call;
        asks the sidecar about late calls again (never waits for it)."""
        with self._lock:
            out = (self._loaded, self._saved, self._failed)
            self._loaded, self._saved, self._failed = set(), set(), set()
            poll = (
                bool(self._late_loads or self._late_saves)
                and not self._polling
                and time.monotonic() - self._polled_at >= POLL_INTERVAL_S
            )
            if poll:
                self._polling = True
        if poll:
            self._thread.submit(self._poll)
        return out

    @property
    def late(self) -> tuple[set[str], set[str]]:
        """(loads, saves) reported pending and not settled yet."""
        with self._lock:
            return set(self._late_loads), set(self._late_saves)

    def _poll(self) -> None:
        with self._lock:
            loads, saves = set(self._late_loads), set(self._late_saves)
        try:
            running_loads, running_saves = self.link.pool_poll(sorted(loads), sorted(saves))
        except SidecarGone:
            # Its process is gone, and its Mooncake calls with it: nothing writes or reads now.
            running_loads, running_saves = set(), set()
        except KVSidecarError as e:
            log.warning("late KV pool calls not polled (%s); asking again", e)
            running_loads, running_saves = loads, saves
        with self._lock:
            for req in loads - running_loads:
                log.warning("request %s: late KV pool load settled; recomputing", req)
                self._late_loads.discard(req)
                self._loaded.add(req)
                self._failed.add(req)  # nothing checked what the late get wrote
            for req in saves - running_saves:
                self._late_saves.discard(req)
                self._ended(req)
            self._polling = False
            self._polled_at = time.monotonic()

    def _load(self, job: PoolJob) -> None:
        try:
            reply = self.link.pool_load(
                job.req_id,
                job.token_ids,
                job.block_ids,
                job.tokens,
                job.key_runs,
                held_tokens=job.held,
            )
            failed = any(reply.failed_blocks)
            late = reply.pending
        except SidecarGone as e:
            log.error("request %s: KV pool load failed (%s); recomputing", job.req_id, e)
            failed, late = True, False
        except DeadlineExceeded as e:
            log.error("request %s: KV pool load unanswered (%s); waiting for it", job.req_id, e)
            failed, late = True, True
        except KVSidecarError as e:
            log.error("request %s: KV pool load failed (%s); recomputing", job.req_id, e)
            failed, late = True, False
        if late:
            with self._lock:
                self._late_loads.add(job.req_id)
            return
        with self._lock:
            self._loaded.add(job.req_id)
            if failed:
                self._failed.add(job.req_id)

    def _save(self, job: PoolJob, ready: Event | None = None) -> None:
        late, ok = False, False
        rid = request_of(job.req_id)
        stored = min(job.stored, self._floors.get(rid, job.stored))
        try:
            if ready is not None:
                ready.synchronize()
            reply = self.link.pool_save(
                job.req_id,
                job.token_ids,
                job.block_ids,
                job.tokens,
                job.key_runs,
                stored_tokens=stored,
            )
            late = bool(reply.get("pending"))
            ok = not (reply.get("failed") or reply.get("backpressure"))
        except DeadlineExceeded as e:
            log.warning(
                "request %s: KV pool save unanswered (%s); holding its blocks", job.req_id, e
            )
            late, ok = True, True  # it may well store everything: the poll settles it
        except KVSidecarError as e:
            log.warning("request %s: not stored in the KV pool: %s", job.req_id, e)
        if not job.running:
            self._floors.pop(rid, None)  # the request's last store
        elif not ok:
            self._floors[rid] = stored
            while len(self._floors) > MAX_FLOORS:
                del self._floors[next(iter(self._floors))]
        else:
            self._floors.pop(rid, None)  # it stored everything from the floor on
        with self._lock:
            if late:
                self._late_saves.add(job.req_id)
            else:
                self._ended(job.req_id)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        self.link.close(unlink=False)
