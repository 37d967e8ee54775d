"""The rendezvous where decode's connector hands over its target for a transfer id.

The flow opens a transfer id before it sends the request to decode; decode's connector POSTs
``{"transfer_id", "target"}`` (or ``{"transfer_id", "error"}``) to ``/v1/kv_targets`` once its
blocks are allocated. Decode first, the flow waits on that id and then sends the prompt to
prefill; concurrent, prefill's connector (every rank) GETs ``/v1/kv_targets/<id>`` and waits.

Each id is opened with its transfer's token (bodies.py); every post and fetch must carry it, or
is refused (401) before anything about the id is said. An id this rendezvous does not know (never
issued, or forgotten) is refused alike, same status and same sentence: a stranger cannot tell
live ids from made-up ones. The token is forgotten with the id. Refusals are logged throttled
(one line per status per interval, with how many were held back), as the sidecar logs bad
frames: whoever can reach the proxy must not be able to flood its log.

Pipeline parallel: each of decode's ``pp_size`` stages posts a target of its own (its own
sidecar, its own layers) with its ``pp_stage``; an id has its targets once every stage posted,
and prefill's stage k fetches stage k's. Both sides must run the same number of stages.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from app.proxy.bodies import TRANSFER_TOKEN_HEADER, TRANSFER_TOKEN_PARAM
from app.proxy.errors import TargetError
from app.transfer.control.framing import LogThrottle

log = logging.getLogger(__name__)

# Bounds a post's pp_size: far above any real pipeline, and a stranger cannot make an id hold
# many partial targets.
MAX_PP_STAGES = 64
# At most one log line per refused status in this many seconds (the sidecar's interval).
REFUSED_LOG_INTERVAL_S = 5.0
Targets = list[dict[str, Any]]  # decode's target per pipeline stage


@dataclass(frozen=True)
class Delivery:
    """The answer to one POST: HTTP status and a sentence for the connector's log."""

    status: int
    message: str

    @property
    def accepted(self) -> bool:
        return self.status == 200


class TargetRendezvous:
    """Waiters by transfer id; the id resolves once every stage's target came, or at the
    first error posted for it."""

    def __init__(self, remember: int = 1000) -> None:
        self._waiting: dict[str, asyncio.Future[Targets]] = {}
        # Stages posted so far and how many decode runs, for ids still short of a stage.
        self._partial: dict[str, tuple[int, dict[int, dict[str, Any]]]] = {}
        # Why recent ids stopped waiting, so a late post with the token gets a useful answer.
        self._closed: OrderedDict[str, str] = OrderedDict()
        # Each known id's token: waiting ones and the closed ones still remembered.
        self._tokens: dict[str, str] = {}
        self._remember = remember
        self._throttle = LogThrottle(REFUSED_LOG_INTERVAL_S)

    def open(self, transfer_id: str, token: str) -> None:
        self._waiting[transfer_id] = asyncio.get_running_loop().create_future()
        self._tokens[transfer_id] = token

    def deliver(
        self,
        transfer_id: str,
        token: str | None,
        target: dict[str, Any],
        pp_stage: int = 0,
        pp_size: int = 1,
    ) -> Delivery:
        return self._resolve(transfer_id, token, (pp_stage, pp_size, target), None)

    def fail(self, transfer_id: str, token: str | None, error: str) -> Delivery:
        return self._resolve(transfer_id, token, None, error)

    def refusal(self, transfer_id: str, token: str | None) -> Delivery | None:
        """401 unless ``token`` is the token of ``transfer_id``, an id this rendezvous knows;
        None when it is. An unknown id is answered as a known one with the wrong token: a
        404 there would tell a stranger which ids are live."""
        # Neither token nor id in the answer: a stranger learns nothing from it.
        if token is None:
            return Delivery(
                401,
                f"this transfer needs its token: send the {TRANSFER_TOKEN_HEADER} header with "
                f"the {TRANSFER_TOKEN_PARAM!r} of the kv_transfer_params the proxy sent",
            )
        expected = self._tokens.get(transfer_id)  # None: unknown, so no token matches
        # Constant time: how much of the token matched must not show in the answer's timing.
        if expected is None or not hmac.compare_digest(token.encode(), expected.encode()):
            return Delivery(
                401,
                f"the {TRANSFER_TOKEN_HEADER} header does not match the token of a transfer "
                f"this proxy knows by that id (it forgets ids older than the last "
                f"{self._remember} that ended)",
            )
        return None

    def log_refused(self, delivery: Delivery) -> None:
        """Log a refused post, throttled per status: the kind is the status (a few fixed
        values), never the id or the sentence, which the poster chooses."""
        held = self._throttle.allow(str(delivery.status))
        if held is None:
            return
        more = f" ({held} more {delivery.status}s since the last line)" if held else ""
        log.warning("target post refused (%d): %s%s", delivery.status, delivery.message, more)

    def _resolve(
        self,
        transfer_id: str,
        token: str | None,
        staged: tuple[int, int, dict[str, Any]] | None,
        error: str | None,
    ) -> Delivery:
        refused = self.refusal(transfer_id, token)
        if refused is not None:
            return refused
        fut = self._waiting.get(transfer_id)
        if fut is None:
            return self._gone(transfer_id)
        if fut.done():
            return Delivery(409, f"transfer {transfer_id!r} already has a target")
        if error is not None:
            self._partial.pop(transfer_id, None)
            fut.set_exception(TargetError(f"decode gave no target: {error}"))
            return Delivery(200, "ok")
        assert staged is not None
        stage, size, target = staged
        if not 0 <= stage < size <= MAX_PP_STAGES:
            return Delivery(
                400,
                f"pp_stage {stage} of pp_size {size}: expected 0 <= pp_stage < pp_size <= "
                f"{MAX_PP_STAGES}",
            )
        known, got = self._partial.setdefault(transfer_id, (size, {}))
        if size != known:
            return Delivery(
                409,
                f"decode's stages disagree: pp_size {size}, where an earlier stage said {known}",
            )
        if stage in got:
            return Delivery(409, f"transfer {transfer_id!r} stage {stage} already has a target")
        got[stage] = target
        if len(got) == size:
            del self._partial[transfer_id]
            fut.set_result([got[s] for s in range(size)])
        return Delivery(200, "ok")

    def _gone(self, transfer_id: str) -> Delivery:
        # Its token matched, so the id is waiting or remembered as closed: this one is closed.
        why = self._closed.get(transfer_id, "closed")
        return Delivery(409, f"transfer {transfer_id!r} is no longer waiting: {why}")

    async def wait(self, transfer_id: str, timeout_s: float) -> Targets:
        """The targets (one per decode pipeline stage), or ``TimeoutError`` / ``TargetError``."""
        fut = self._waiting[transfer_id]
        async with asyncio.timeout(timeout_s):
            # Shielded: a timeout must not cancel the future a concurrent post resolves.
            return await asyncio.shield(fut)

    async def fetch(
        self,
        transfer_id: str,
        token: str | None,
        timeout_s: float,
        pp_stage: int = 0,
        pp_size: int = 1,
    ) -> dict[str, Any] | Delivery:
        """For prefill's connector (its stage ``pp_stage`` of ``pp_size``): decode's target for
        that stage once every stage posted, or why none will come (401 wrong token or unknown
        id, 409 the id stopped waiting, decode posted an error or runs another number of
        stages, 504 not within ``timeout_s``). Any number of callers may wait on one id."""
        refused = self.refusal(transfer_id, token)
        if refused is not None:
            return refused
        fut = self._waiting.get(transfer_id)
        if fut is None:
            return self._gone(transfer_id)
        try:
            async with asyncio.timeout(timeout_s):
                got = await asyncio.shield(fut)
            if len(got) != pp_size or not 0 <= pp_stage < pp_size:
                return Delivery(
                    409,
                    f"decode runs {len(got)} pipeline stage(s) and prefill {pp_size} (this is "
                    f"stage {pp_stage}): each decode stage takes the layers of the prefill stage "
                    "of its number, so run both with the same pipeline_parallel_size",
                )
            return got[pp_stage]
        except TargetError as e:
            return Delivery(409, str(e))
        except TimeoutError:
            return Delivery(504, f"no target for transfer {transfer_id!r} within {timeout_s:g} s")
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if fut.cancelled() and (task is None or not task.cancelling()):
                return self._gone(transfer_id)  # closed while we waited
            raise

    def close(self, transfer_id: str, reason: str) -> None:
        """Stop waiting for ``transfer_id``; later posts for it are told ``reason``."""
        fut = self._waiting.pop(transfer_id, None)
        self._partial.pop(transfer_id, None)
        if fut is None:
            return
        if fut.done() and not fut.cancelled():
            fut.exception()  # retrieved, so asyncio does not log an unobserved TargetError
        else:
            fut.cancel()
        self._closed[transfer_id] = reason
        while len(self._closed) > self._remember:
            gone, _ = self._closed.popitem(last=False)
            self._tokens.pop(gone, None)

    def __len__(self) -> int:
        return len(self._waiting)
