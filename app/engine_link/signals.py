"""A rank's ``LayerReady`` messages on their way to the sidecar, in the engine's order (the
engine link's part that waits on device events in a thread of its own)."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from app.devices import CpuEvent, Event
from app.errors import KVSidecarError
from app.transfer.wire.protocol import LayerReady

log = logging.getLogger(__name__)


class LayerSignals:
    """A rank's ``LayerReady`` messages, in the order the engine signalled them. One whose
    event is not complete yet waits in a thread (not in the caller), and every later message
    queues behind it."""

    def __init__(self, send: Callable[[LayerReady], None]) -> None:
        self._send = send
        self._cond = threading.Condition()
        # The head stays queued while it is sent, so that a caller never overtakes it.
        self._queue: deque[tuple[LayerReady, Event | None]] = deque()
        self._thread: threading.Thread | None = None
        self._closed = False

    def put(self, msg: LayerReady, event: Event | None) -> None:
        complete = event is None or isinstance(event, CpuEvent) or event.query()
        with self._cond:
            if self._closed:
                raise KVSidecarError("the engine link is closed")
            if complete and not self._queue:
                queued = False
            else:
                self._queue.append((msg, None if complete else event))
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="kvs-layer-ready", daemon=True
                    )
                    self._thread.start()
                self._cond.notify()
                queued = True
        if not queued:
            self._send(msg)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                msg, event = self._queue[0]
            try:
                if event is not None:
                    event.synchronize()
                with self._cond:
                    if self._closed:
                        return  # the link closed while the event was pending
                self._send(msg)
            except Exception:
                # Not signalled: the layer's requests end at the sidecar's deadline.
                log.exception("layer %d of step %d not signalled", msg.layer, msg.step)
            with self._cond:
                self._queue.popleft()

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the thread; messages still waiting for their events are dropped."""
        with self._cond:
            self._closed = True
            dropped = len(self._queue)
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if dropped:
            log.warning("engine link closed with %d layer signal(s) still waiting", dropped)
