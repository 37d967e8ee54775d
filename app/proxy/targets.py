"""The rendezvous where decode's connector hands over its target for a transfer id.

The flow opens a transfer id before it sends the request to decode; decode's connector POSTs
``{"transfer_id", "target"}`` (or ``{"transfer_id", "error"}``) to ``/v1/kv_targets`` once its
blocks are allocated. Decode first, the flow waits on that id and then sends the prompt to
prefill; concurrent, prefill's connector (every rank) GETs ``/v1/kv_targets/<id>`` and waits.

Each id is opened with its transfer's token (bodies.py); every post and fetch for an id this
rendezvous knows must carry it, or is refused (401) before anything about the id is said. The
token is forgotten with the id.
"""

from __future__ import annotations

import asyncio
import hmac
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from app.proxy.bodies import TRANSFER_TOKEN_HEADER, TRANSFER_TOKEN_PARAM
from app.proxy.errors import TargetError


@dataclass(frozen=True)
class Delivery:
    """The answer to one POST: HTTP status and a sentence for the connector's log."""

    status: int
    message: str

    @property
    def accepted(self) -> bool:
        return self.status == 200


class TargetRendezvous:
    """Waiters by transfer id; the first target (or error) posted for an id resolves it."""

    def __init__(self, remember: int = 1000) -> None:
        self._waiting: dict[str, asyncio.Future[dict[str, Any]]] = {}
        # Why recent ids stopped waiting, so a late post gets a useful answer instead of 404.
        self._closed: OrderedDict[str, str] = OrderedDict()
        # Each known id's token: waiting ones and the closed ones still remembered.
        self._tokens: dict[str, str] = {}
        self._remember = remember

    def open(self, transfer_id: str, token: str) -> None:
        self._waiting[transfer_id] = asyncio.get_running_loop().create_future()
        self._tokens[transfer_id] = token

    def deliver(self, transfer_id: str, token: str | None, target: dict[str, Any]) -> Delivery:
        return self._resolve(transfer_id, token, target, None)

    def fail(self, transfer_id: str, token: str | None, error: str) -> Delivery:
        return self._resolve(transfer_id, token, None, error)

    def refusal(self, transfer_id: str, token: str | None) -> Delivery | None:
        """401 when ``transfer_id`` is known and ``token`` is not its token; None otherwise
        (an unknown id has nothing to reveal: its answer stays 404)."""
        expected = self._tokens.get(transfer_id)
        if expected is None:
            return None
        # Neither token nor id in the answer: a stranger learns nothing from it.
        if token is None:
            return Delivery(
                401,
                f"this transfer needs its token: send the {TRANSFER_TOKEN_HEADER} header with "
                f"the {TRANSFER_TOKEN_PARAM!r} of the kv_transfer_params the proxy sent",
            )
        # Constant time: how much of the token matched must not show in the answer's timing.
        if not hmac.compare_digest(token.encode(), expected.encode()):
            return Delivery(
                401,
                f"the {TRANSFER_TOKEN_HEADER} header does not match this transfer's token",
            )
        return None

    def _resolve(
        self,
        transfer_id: str,
        token: str | None,
        target: dict[str, Any] | None,
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
            fut.set_exception(TargetError(f"decode gave no target: {error}"))
        else:
            assert target is not None
            fut.set_result(target)
        return Delivery(200, "ok")

    def _gone(self, transfer_id: str) -> Delivery:
        why = self._closed.get(transfer_id)
        if why is not None:
            return Delivery(409, f"transfer {transfer_id!r} is no longer waiting: {why}")
        return Delivery(
            404,
            f"unknown transfer {transfer_id!r}: this proxy did not issue it "
            f"(or it is older than the last {self._remember})",
        )

    async def wait(self, transfer_id: str, timeout_s: float) -> dict[str, Any]:
        """The target, or ``TimeoutError`` / ``TargetError``."""
        fut = self._waiting[transfer_id]
        async with asyncio.timeout(timeout_s):
            # Shielded: a timeout must not cancel the future a concurrent post resolves.
            return await asyncio.shield(fut)

    async def fetch(
        self, transfer_id: str, token: str | None, timeout_s: float
    ) -> dict[str, Any] | Delivery:
        """For prefill's connector: the target once posted, or why none will come (401 wrong
        token, 409 the id stopped waiting or decode posted an error, 404 unknown, 504 not
        within ``timeout_s``). Any number of callers may wait on one id."""
        refused = self.refusal(transfer_id, token)
        if refused is not None:
            return refused
        fut = self._waiting.get(transfer_id)
        if fut is None:
            return self._gone(transfer_id)
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(fut)
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
