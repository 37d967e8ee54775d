"""Engine saves and loads while Mooncake runs them, and after: the pool's quarantine.

A Mooncake get or put cannot be cancelled: one past the pool's timeout runs on in its thread
and writes (get) or reads (put) the engine's blocks whenever it resumes (a stopped peer
segment's holder woken by SIGCONT: measured). So the engine is told only what is true: a call
past its timeout is answered *pending*, and the engine keeps the request's blocks (a load's
request does not run, a save's blocks are not freed) until a poll (``PoolPoll``) finds the call
returned. A load that went late is then reported failed (recomputed): nothing checked what it
wrote. A put reads the request's own bytes all along (its blocks are pinned), so whatever it
filed is the request's and stays.

``quarantine_max_s`` bounds no wait of any thread (the engine polls, nothing blocks on the
call); past it a call is logged as stuck and counted, and its blocks stay out of reuse: giving
them back while a transfer may still land in them is the wrong answer this exists to prevent.
Mooncake's TCP transport ends a transfer that made no progress for 30 s itself (measured), so a
call stuck longer means something else is wrong.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

log = logging.getLogger(__name__)

Kind = Literal["save", "load"]


@dataclass
class Running:
    """One engine call whose store call has not returned yet (or returned late, unpolled)."""

    kind: Kind
    rank: int
    request: str
    started: float  # monotonic
    detail: Any = None  # what ``/v1/pool`` shows of it (the service's own record)
    late: concurrent.futures.Future[Any] | None = None
    stuck: bool = False

    @property
    def settled(self) -> bool:
        return self.late is not None and self.late.done()


@dataclass
class LateCounters:
    """Totals for ``/metrics`` and ``/v1/pool``."""

    late_loads: int = 0  # loads answered pending (past the timeout)
    late_saves: int = 0
    released: int = 0  # late calls returned since, their blocks given back to the engine
    stuck: int = 0  # late calls still running past quarantine_max_s


class RunningCalls:
    """The engine calls the pool service runs now, and those that went late."""

    def __init__(
        self, quarantine_max_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.quarantine_max_s = quarantine_max_s
        self._clock = clock
        self._ids = itertools.count()
        self._calls: dict[int, Running] = {}
        self.counters = LateCounters()

    def begin(self, kind: Kind, rank: int, request: str, detail: Any = None) -> int:
        """Register a call before it reaches the store (the engine's next poll then sees it)."""
        self._prune()
        call_id = next(self._ids)
        self._calls[call_id] = Running(kind, rank, request, self._clock(), detail)
        return call_id

    def end(
        self,
        call_id: int,
        late: concurrent.futures.Future[Any] | None,
        on_return: Callable[[], None] | None = None,
    ) -> bool:
        """The service has its answer; True when the store call still runs (``late``): the
        engine is answered pending. ``on_return`` runs when that call returns (at once if it
        did already), on whichever thread completes it."""
        call = self._calls[call_id]
        if late is None:
            del self._calls[call_id]
            if on_return is not None:
                on_return()
            return False
        call.late = late
        if call.kind == "load":
            self.counters.late_loads += 1
        else:
            self.counters.late_saves += 1
        log.warning(
            "request %s: pool %s of rank %d ran past its timeout; its blocks stay the "
            "store's until Mooncake returns",
            call.request,
            call.kind,
            call.rank,
        )
        if on_return is not None:
            late.add_done_callback(lambda _: on_return())
        return True

    def running(self, rank: int, kind: Kind, requests: Iterable[str]) -> list[str]:
        """Those of ``requests`` with a call of ``kind`` still running; every other one is
        settled (returned, or never reached the store), and forgotten here."""
        wanted = set(requests)
        out: set[str] = set()
        for call_id, call in list(self._calls.items()):
            if call.rank != rank or call.kind != kind or call.request not in wanted:
                continue
            if call.settled:
                self._settle(call_id)
                continue
            self._check_stuck(call)
            out.add(call.request)
        return sorted(out)

    def calls(self) -> list[Running]:
        """Calls the store has not returned yet, oldest first."""
        self._prune()
        return [dataclasses.replace(c) for c in self._calls.values()]

    def _check_stuck(self, call: Running) -> None:
        age = self._clock() - call.started
        if call.late is None or call.stuck or age <= self.quarantine_max_s:
            return
        call.stuck = True
        self.counters.stuck += 1
        log.error(
            "request %s: pool %s of rank %d still runs after %.1f s (quarantine_max_s %g s); "
            "its blocks stay out of reuse until Mooncake returns (is a pool segment's holder "
            "stopped, or its network gone?)",
            call.request,
            call.kind,
            call.rank,
            age,
            self.quarantine_max_s,
        )

    def _settle(self, call_id: int) -> None:
        call = self._calls.pop(call_id)
        self.counters.released += 1
        log.info(
            "request %s: late pool %s of rank %d returned after %.1f s; its blocks are the "
            "engine's again",
            call.request,
            call.kind,
            call.rank,
            self._clock() - call.started,
        )

    def _prune(self) -> None:
        # Late calls nobody polls for (the engine went away) must not pile up.
        for call_id, call in list(self._calls.items()):
            if call.settled:
                self._settle(call_id)
            else:
                self._check_stuck(call)
