"""The finished bell: a counter in shared memory that a sidecar moves whenever one of an engine
rank's requests may have something for ``get_finished``, so that an engine with no forward
pass to run asks its sidecar only when there is news.

While decode's engine holds only requests waiting for their KV, vLLM calls the connector's
``get_finished`` on every turn of its loop (``connectors.vllm.pacing``: 100 a second); each
was a round trip to the sidecar, and over a long prefill those round trips were most of the
transfer path's CPU (docs/benchmarks.md, "Where the CPU goes"). The engine now reads the bell
(a load from its own mapping, no system call) and asks only when it moved, or once per
``SAFETY_S`` whatever it says: a ring the sidecar missed costs at most that much latency,
never a request.

The engine creates the file and names it in its registration; the sidecar maps it and says
so in its reply, then the engine removes the name (both keep their mappings). A sidecar that
cannot map it (no shared ``/dev/shm``) answers without it, and the engine asks every time, as
before. Each registration, a restarted sidecar's too, gets a fresh bell.
"""

from __future__ import annotations

import mmap
import secrets
import threading
import time
from collections.abc import Callable

from app.devices.shm import create_file, open_file, unlink_file

SIZE = 64  # one cache line: the counter and nothing else on it
SAFETY_S = 1.0  # the engine asks at least this often, rung or not
_MASK = (1 << 64) - 1


class Bell:
    """A 64-bit counter in a shared-memory file: ``ring`` (sidecar) moves it, ``read`` (engine)
    returns it. Only a change means anything; its value does not."""

    def __init__(self, name: str, mem: mmap.mmap) -> None:
        self.name = name
        self._mem = mem
        self._count = memoryview(mem).cast("Q")
        self._lock = threading.Lock()  # rings come from the loop and from completion threads
        self._closed = False

    @classmethod
    def create(cls, prefix: str) -> Bell:
        """A new bell (engine side), named after ``prefix``."""
        name = f"{prefix}-bell-{secrets.token_hex(4)}"
        return cls(name, create_file(name, SIZE))

    @classmethod
    def open(cls, name: str) -> Bell:
        """The engine's bell ``name`` (sidecar side); ``ConfigError`` when it cannot be mapped."""
        return cls(name, open_file(name, SIZE, "the finished bell's size"))

    def ring(self) -> None:
        """Move the counter; nothing once closed (a late ring of a replaced registration)."""
        with self._lock:
            if not self._closed:
                self._count[0] = (self._count[0] + 1) & _MASK

    def read(self) -> int:
        return int(self._count[0])

    def unlink(self) -> None:
        """Remove the name; both mappings stay."""
        unlink_file(self.name)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._count.release()
            self._mem.close()


class BellWatch:
    """The engine's view of its bell: whether to ask the sidecar now (``due``), and the value
    seen by the last ask (``asking``, called before each round trip: a ring during the call is
    seen by the next ``due``)."""

    def __init__(
        self,
        bell: Bell | None,
        safety_s: float = SAFETY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bell = bell
        self.safety_s = safety_s
        self._clock = clock
        self._seen: int | None = None
        self._asked_at = -float("inf")

    def due(self) -> bool:
        """Whether something may have finished since the last ask (always, without a bell)."""
        if self.bell is None or self._seen is None:
            return True
        if self.bell.read() != self._seen:
            return True
        return self._clock() - self._asked_at >= self.safety_s

    def asking(self) -> None:
        """A round trip starts now."""
        if self.bell is not None:
            self._seen = self.bell.read()
        self._asked_at = self._clock()
