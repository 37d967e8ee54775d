"""Retries the proxy may make when an upstream fails, and the budget that caps them.

A retry is worth making only where it cannot harm: a prefill the prompt never reached (the
connection could not be made) is retried for the same transfer on another prefill; a decode
that failed before the client received a byte is retried as a new transfer on another decode.
Each costs the budget one retry; the budget allows ``ratio`` retries per request seen over the
last ``window_s`` seconds, and at least ``minimum`` per window (as Envoy's and gRPC's retry
budgets do), so that when every instance fails the proxy does not double its load.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Stage = Literal["prefill", "decode"]
# Why a stage was retried: the prompt never reached it, it broke off before answering, it
# answered 5xx, or it broke off mid-stream and the stream went on elsewhere (migration.py).
Reason = Literal["connect", "reset", "status_5xx", "mid_stream"]
# Buckets a window is cut into: a request leaves the window at most window_s / BUCKETS late.
BUCKETS = 10


@dataclass(frozen=True)
class Retry:
    """One retry, as the transfer record shows it: which stage failed where, and why."""

    stage: Stage
    reason: Reason
    instance: str  # the instance that failed
    error: str
    transfer_id: str  # the transfer the failed attempt ran under


@dataclass(frozen=True)
class BudgetSettings:
    ratio: float = 0.1
    minimum: int = 3
    window_s: float = 10.0


class RetryBudget:
    """Requests and retries over a sliding window; ``clock`` is injectable for tests."""

    def __init__(
        self, settings: BudgetSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self.clock = clock
        self._width = settings.window_s / BUCKETS
        # (bucket number, requests, retries), oldest first; buckets older than the window go.
        self._buckets: deque[list[int]] = deque()

    def _bucket(self) -> list[int]:
        now = int(self.clock() / self._width)
        while self._buckets and self._buckets[0][0] <= now - BUCKETS:
            self._buckets.popleft()
        if not self._buckets or self._buckets[-1][0] != now:
            self._buckets.append([now, 0, 0])
        return self._buckets[-1]

    def request(self) -> None:
        """A client request came (each one, retried or not, earns the budget ``ratio``)."""
        self._bucket()[1] += 1

    def allowed(self) -> int:
        """Retries the window allows in all."""
        self._bucket()
        requests = sum(b[1] for b in self._buckets)
        return max(self.settings.minimum, int(requests * self.settings.ratio))

    def used(self) -> int:
        self._bucket()
        return sum(b[2] for b in self._buckets)

    def take(self) -> bool:
        """Spend one retry if the window has one left."""
        if self.used() >= self.allowed():
            return False
        self._bucket()[2] += 1
        return True
