"""The KV pool as the prefill pick's second tier (README "Routing by KV events").

Every prefill instance's connector looks its prompt up in the shared KV pool (Mooncake Store)
and loads the hit instead of computing it. So an instance that holds none of a prompt in its
own cache still computes only what the pool lacks, at the price of the load. The proxy asks
the pool once per pick (``POST /v1/pool/lookup`` on a sidecar of the pool, the whole prompt with
its ``cache_salt`` and ``model``, as the connector asks) and scores each candidate with

    engine hit + (1 - load_cost) * max(0, pool hit - engine hit)

``load_cost``: what loading one token from the pool costs, in computed tokens (0: as good as
the engine's own cache; 1: worth nothing). A lookup that fails or comes late leaves the pick
to the first tier, and the record says why.

The lookup tells whether a token sequence is cached, so a sidecar with an admin token answers
it only with that token: the proxy sends it as a bearer token (``pool_lookup_token``). A
refusal (401/403) is a deployment error, not a passing fault: it is logged as a warning, not
only noted in the record, since every pick would silently go without the pool.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import httpx

from app.proxy.config import POOL_TOKEN_ENV, POOL_TOKEN_FLAG
from app.proxy.routing import RequestShape

log = logging.getLogger(__name__)
# Answers that mean the proxy's credential is missing or wrong, not that the pool failed.
_REFUSED = (401, 403)

POOL = "pool"
ENGINE = "engine"


@dataclass(frozen=True)
class PoolAnswer:
    """What the pool holds of one prompt (``tokens``), or why the pick goes without (``note``)."""

    tokens: int
    load_cost: float
    note: str | None = None

    def weigh(self, engine_hit: int) -> tuple[float, str]:
        """A candidate's hit in computed-token terms and the tier it comes from."""
        extra = self.tokens - engine_hit
        if extra <= 0:
            return float(engine_hit), ENGINE
        return engine_hit + (1.0 - self.load_cost) * extra, POOL


class PoolTier:
    """Asks one sidecar of the shared pool how much of a prompt it serves."""

    def __init__(
        self,
        url: str,
        client: httpx.AsyncClient,
        load_cost: float,
        timeout_s: float,
        token: str | None = None,
    ) -> None:
        self.url = f"{url.rstrip('/')}/v1/pool/lookup"
        self.client = client
        self.load_cost = load_cost
        self.timeout_s = timeout_s
        self._headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        self._refused = False  # warned about a refused credential (once until it works)

    async def lookup(self, shape: RequestShape) -> PoolAnswer:
        if shape.token_ids is None:
            return self._without("a text prompt: the proxy has no tokenizer to key it")
        # The whole prompt, as the connector asks: the hit leaves the last token to compute.
        ids = list(shape.token_ids)
        if len(ids) < 2:
            return PoolAnswer(0, self.load_cost)
        # The tenant: a salted or adapter prompt is scored on its own entries only.
        body = {"token_ids": ids, "cache_salt": shape.cache_salt, "model": shape.model}
        try:
            r = await self.client.post(
                self.url, json=body, headers=self._headers, timeout=self.timeout_s
            )
        except httpx.HTTPError as e:
            return self._without(f"pool lookup failed: {type(e).__name__}: {e}")
        if r.status_code in _REFUSED:
            return self._refusal(r)
        self._refused = False
        if r.status_code != 200:
            return self._without(f"pool lookup answered {r.status_code}: {r.text[:200]}")
        try:
            hit = r.json().get("hit_tokens")
        except (ValueError, AttributeError):
            hit = None
        if type(hit) is not int or not 0 <= hit < len(ids):
            return self._without(f"pool lookup answered an unusable hit: {hit!r}")
        return PoolAnswer(hit, self.load_cost)

    def _refusal(self, r: httpx.Response) -> PoolAnswer:
        given = "a token" if self._headers else "no token"
        why = (
            f"pool lookup answered {r.status_code} to {given}: expected the pool sidecar's "
            f"admin token in {POOL_TOKEN_FLAG} or {POOL_TOKEN_ENV}"
        )
        if not self._refused:
            self._refused = True
            log.warning("every prefill pick goes without the pool tier: %s", why)
        return self._without(why)

    def _without(self, why: str) -> PoolAnswer:
        log.debug("prefill pick without the pool tier: %s", why)
        return PoolAnswer(0, self.load_cost, why)
