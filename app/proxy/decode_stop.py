"""Telling decode's sidecar to stop waiting for a transfer whose prefill the proxy knows is gone.

Decode's sidecar waits for prefill's writes until its deadline (10 s typical), then decode
recomputes. When the proxy saw the prefill fail for good (and no retry is coming), it aborts
the transfer at decode's sidecar through its admin API (``POST /v1/requests/<transfer id>/
abort``, the transfer id being decode's request id there): the load fails now and decode
recomputes at once. A prefill that had claimed decode's blocks is asked by decode's sidecar to
confirm it stopped writing before the blocks are reused (receiving.py's quarantine), so the
abort is safe while that prefill's sidecar still lives.

The abort needs the transfer to be known there, i.e. decode to have expected it: that is so
once decode posted its target, which the proxy waits for (bounded by the target timeout).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httpx

from app.proxy.config import ProxyConfig
from app.proxy.exchange import describe

log = logging.getLogger(__name__)

# A 404 just after the target came: decode's sidecar may not have taken the expect yet.
NOT_YET_TRIES = 3
NOT_YET_PAUSE_S = 0.05
ABORT_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class StopAnswer:
    """What one of decode's sidecars answered: ``ok`` (aborted, or it had ended already)."""

    admin_url: str
    ok: bool
    detail: str


class DecodeStopper:
    """Aborts a transfer at the sidecars of the decode instance that waits for it."""

    def __init__(self, cfg: ProxyConfig, client: httpx.AsyncClient) -> None:
        self._admins = {s.decode: s.admin_urls for s in cfg.decode_sidecars}
        token = cfg.decode_sidecar_token
        self._headers = {} if token is None else {"authorization": f"Bearer {token}"}
        self._client = client

    def knows(self, decode: str) -> bool:
        return decode in self._admins

    async def stop(self, decode: str, transfer_id: str, reason: str) -> list[StopAnswer]:
        """Abort ``transfer_id`` at every sidecar of ``decode`` (none known: nothing to do)."""
        urls = self._admins.get(decode, ())
        return list(await asyncio.gather(*(self._abort(u, transfer_id, reason) for u in urls)))

    async def _abort(self, admin: str, tid: str, reason: str) -> StopAnswer:
        url = f"{admin}/v1/requests/{tid}/abort"
        for attempt in range(NOT_YET_TRIES):
            try:
                r = await self._client.post(
                    url,
                    json={"reason": reason[:500]},
                    headers=self._headers,
                    timeout=ABORT_TIMEOUT_S,
                )
            except httpx.HTTPError as e:
                return StopAnswer(admin, False, f"unreachable: {describe(e)}")
            if r.status_code == 404 and attempt + 1 < NOT_YET_TRIES:
                await asyncio.sleep(NOT_YET_PAUSE_S)
                continue
            # 409: it ended already (the load finished or failed on its own): nothing to stop.
            if r.status_code in (200, 409):
                return StopAnswer(admin, True, f"answered {r.status_code}")
            return StopAnswer(admin, False, f"answered {r.status_code}: {r.text[:200]}")
        raise AssertionError("unreachable")  # the loop returns on its last try
