"""A fixed pool of daemon threads for blocking Mooncake Store calls (``app.store.pool``).

Daemon threads, because a call into a dead master can block for seconds, and
``concurrent.futures``' pools join their threads at interpreter exit.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class DaemonExecutor:
    """A fixed number of daemon threads draining one queue of blocking calls."""

    def __init__(self, max_workers: int, name: str) -> None:
        self._queue: queue.SimpleQueue[
            tuple[concurrent.futures.Future[Any], Callable[[], Any]] | None
        ] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = 0
        self._idle = threading.Condition(self._lock)
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(max_workers)
        ]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            self._pending += 1
        self._queue.put((fut, fn))
        return fut

    def _done(self) -> None:
        with self._lock:
            self._pending -= 1
            if self._pending == 0:
                self._idle.notify_all()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._run(*item)
            # Drop the job now: an idle worker must not keep a closed store alive.
            del item

    def _run(self, fut: concurrent.futures.Future[Any], fn: Callable[[], Any]) -> None:
        try:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                result = fn()
            except BaseException as exc:
                fut.set_exception(exc)
            else:
                fut.set_result(result)
        finally:
            self._done()

    def wait_idle(self, timeout_s: float | None) -> bool:
        with self._lock:
            return self._idle.wait_for(lambda: self._pending == 0, timeout=timeout_s)

    def shutdown(self) -> None:
        # No join: a worker stuck in a dead master's call must not block the caller.
        for _ in self._threads:
            self._queue.put(None)
