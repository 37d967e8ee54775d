"""A rank's KV pool loads and stores, off the forward path.

One thread with its own engine link (a ZMQ socket belongs to one thread): a load or a store
takes as long as Mooncake Store needs, and the engine only learns the outcome from
``get_finished`` like any other asynchronous transfer.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

from app.connectors.vllm.config import ConnectorConfig
from app.connectors.vllm.metadata import PoolJob
from app.engine_link.client import EngineLink
from app.errors import KVSidecarError

log = logging.getLogger(__name__)


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

    def load(self, job: PoolJob) -> None:
        self._thread.submit(self._load, job)

    def save(self, job: PoolJob) -> None:
        self._thread.submit(self._save, job)

    def drain(self) -> tuple[set[str], set[str], set[str]]:
        """Requests loaded, stored, and failed to load (whole or in part) since the last call."""
        with self._lock:
            out = (self._loaded, self._saved, self._failed)
            self._loaded, self._saved, self._failed = set(), set(), set()
        return out

    def _load(self, job: PoolJob) -> None:
        try:
            reply = self.link.pool_load(
                job.req_id,
                job.token_ids,
                job.block_ids,
                job.tokens,
                job.extra_keys,
                held_tokens=job.held,
            )
            failed = any(reply.failed_blocks)
        except KVSidecarError as e:
            log.error("request %s: KV pool load failed (%s); recomputing", job.req_id, e)
            failed = True
        with self._lock:
            self._loaded.add(job.req_id)
            if failed:
                self._failed.add(job.req_id)

    def _save(self, job: PoolJob) -> None:
        try:
            self.link.pool_save(
                job.req_id, job.token_ids, job.block_ids, job.tokens, job.extra_keys
            )
        except KVSidecarError as e:
            log.warning("request %s: not stored in the KV pool: %s", job.req_id, e)
        with self._lock:
            self._saved.add(job.req_id)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        self.link.close(unlink=False)
