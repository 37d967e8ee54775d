"""KV pool lookups off vLLM's scheduler loop.

``get_num_new_matched_tokens`` runs inside the scheduler; a lookup asks the sidecar, which asks
Mooncake Store. Here it runs on a thread of its own with its own engine link (a ZMQ socket
belongs to one thread); the hook answers None ("not known yet", vLLM asks again next step)
until the result is in, so a slow or silent sidecar never holds up other requests.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from app.connectors.vllm.config import ConnectorConfig
from app.engine_link.client import EngineLink
from app.errors import KVSidecarError
from app.store.hashing import KeyRun

log = logging.getLogger(__name__)

# How long the hook waits for a fresh lookup before answering "not yet": a healthy local
# sidecar answers within it, so a request is not delayed a whole step for nothing.
_FIRST_WAIT_S = 0.005


class PoolLookups:
    def __init__(self, config: ConnectorConfig) -> None:
        self._config = config
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvs-lookup")
        self._link: EngineLink | None = None  # made and used on the lookup thread only
        self._pending: dict[str, Future[int]] = {}

    def hit(
        self, rid: str, token_ids: Sequence[int], key_runs: Sequence[KeyRun] = ()
    ) -> int | None:
        """Tokens the pool holds for ``rid``'s prompt, or None while the lookup runs."""
        fut = self._pending.get(rid)
        if fut is None:
            fut = self._pending[rid] = self._thread.submit(
                self._lookup, rid, list(token_ids), list(key_runs)
            )
            try:
                fut.result(timeout=_FIRST_WAIT_S)
            except FutureTimeout:
                return None
        if not fut.done():
            return None
        del self._pending[rid]
        return fut.result()

    def forget(self, rid: str) -> None:
        """The request ended: a lookup still running is answered to nobody."""
        self._pending.pop(rid, None)

    def _lookup(self, rid: str, token_ids: list[int], key_runs: list[KeyRun]) -> int:
        if self._link is None:
            c = self._config
            self._link = EngineLink(c.sidecar, c.engine_id, 0, timeout_s=c.link_timeout_s)
        try:
            return self._link.pool_lookup(rid, token_ids, key_runs)
        except KVSidecarError as e:
            log.warning("request %s: KV pool lookup failed (%s); computing it", rid, e)
            return 0

    def close(self) -> None:
        for fut in self._pending.values():
            fut.cancel()
        self._thread.submit(self._close_link)  # on the thread that owns the link
        self._thread.shutdown(wait=False)

    def _close_link(self) -> None:
        if self._link is not None:
            self._link.close(unlink=False)
