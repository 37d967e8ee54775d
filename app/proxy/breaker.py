"""A circuit breaker per instance: failing instances are taken out, then probed back.

closed ── ``failures`` consecutive failures ──► open (never picked)
open ── ``probe_interval_s`` later, ``GET /health`` ──► 200: half_open; else: open again
half_open ── one request allowed ──► success: closed; failure: open again

A failure is a connection failure, any other transport error or timeout, or a 5xx answer;
a 4xx is the client's fault and counts as a success. The /health gate keeps a dead instance
from costing a client request per probe; the one trial request catches an instance whose
/health answers while its completions fail.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

log = logging.getLogger(__name__)


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerSettings:
    failures: int = 3
    probe_interval_s: float = 5.0


class Breaker:
    """One instance's breaker; ``clock`` is injectable for unit tests."""

    def __init__(
        self,
        name: str,
        settings: BreakerSettings,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.settings = settings
        self.clock = clock
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.opened_at: float | None = None
        self.trial_out = False  # half-open: the one allowed request was handed out

    @property
    def allows(self) -> bool:
        """Whether a request may be sent now."""
        if self.state is BreakerState.CLOSED:
            return True
        return self.state is BreakerState.HALF_OPEN and not self.trial_out

    def take(self) -> bool:
        """A request is being sent; True when it is the half-open trial."""
        if self.state is BreakerState.HALF_OPEN:
            self.trial_out = True
            return True
        return False

    def success(self) -> None:
        if self.state is not BreakerState.CLOSED:
            log.info("%s: breaker closed (the instance answered again)", self.name)
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.trial_out = False
        self.opened_at = None

    def failure(self, why: str) -> None:
        self.consecutive_failures += 1
        if self.state is BreakerState.HALF_OPEN or (
            self.state is BreakerState.CLOSED
            and self.consecutive_failures >= self.settings.failures
        ):
            self._open(why)

    def abandon_trial(self) -> None:
        """The trial request ended without a verdict (client gone): allow another."""
        self.trial_out = False

    def probe_due(self) -> bool:
        """Open for at least one probe interval: time for a ``GET /health``."""
        return (
            self.state is BreakerState.OPEN
            and self.opened_at is not None
            and self.clock() - self.opened_at >= self.settings.probe_interval_s
        )

    def probed(self, ok: bool, why: str = "") -> None:
        """The ``GET /health`` verdict: half-open (one request may go), or open again."""
        if self.state is not BreakerState.OPEN:
            return  # a request's verdict came first
        if ok:
            log.info("%s: breaker half-open (health probe passed)", self.name)
            self.state = BreakerState.HALF_OPEN
            self.trial_out = False
        else:
            self._open(f"health probe failed: {why}")

    def _open(self, why: str) -> None:
        if self.state is not BreakerState.OPEN:
            log.warning(
                "%s: breaker open after %d consecutive failures (%s)",
                self.name,
                self.consecutive_failures,
                why,
            )
        self.state = BreakerState.OPEN
        self.opened_at = self.clock()
        self.trial_out = False


def decode_ok(outcome: str, status: int | None) -> bool | None:
    """The breaker's verdict on a decode request's outcome (None: says nothing)."""
    if outcome == "client_gone":
        return None
    if outcome == "ok":
        return True
    if outcome == "failed":  # decode answered non-200: only 5xx is the instance's fault
        return status is None or status < 500
    return False  # unreachable, timeout, broken
