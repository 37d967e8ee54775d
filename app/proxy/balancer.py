"""Instance pools per role: health, breakers, requests and tokens in flight, the pick policy."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import httpx

from app.proxy.breaker import Breaker, BreakerSettings, BreakerState
from app.proxy.config import Policy
from app.proxy.dp import upstream
from app.proxy.errors import NoHealthyInstance
from app.proxy.pool_tier import PoolAnswer
from app.proxy.precise import APPROXIMATE, IN_FLIGHT, KV_EVENTS, EngineHits, PreciseHit
from app.proxy.routing import InFlightPrefixes, Pick, PrefixIndex, RequestShape, cache_score

log = logging.getLogger(__name__)


class Health(StrEnum):
    UNKNOWN = "unknown"
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"


@dataclass(frozen=True)
class InstanceStatus:
    """What ``/health`` shows for one instance."""

    url: str
    healthy: bool
    health: Health
    outstanding: int
    served: int
    last_error: str | None
    checked_s_ago: float | None
    tokens_in_flight: int
    breaker: BreakerState
    consecutive_failures: int
    prefix_blocks: int | None  # blocks in the prefix index (None: the instance keeps none)


@dataclass
class Instance:
    """One vLLM instance's live state, changed by probes, failures and leases."""

    url: str
    role: str
    breaker: Breaker
    index: PrefixIndex | None = None
    # Instances whose KV events the proxy follows: the prompts of the requests in flight there.
    in_flight: InFlightPrefixes | None = None
    health: Health = Health.UNKNOWN
    outstanding: int = 0
    tokens: int = 0  # in flight
    served: int = 0
    last_error: str | None = None
    checked_at: float | None = None

    @property
    def healthy(self) -> bool:
        return self.health is Health.HEALTHY

    @property
    def available(self) -> bool:
        """May be picked: healthy, and its breaker lets a request through."""
        return self.healthy and self.breaker.allows

    def mark(self, healthy: bool, error: str | None = None) -> None:
        """Record a probe's or a request's verdict; log only the changes."""
        new = Health.HEALTHY if healthy else Health.UNHEALTHY
        if new is not self.health:
            if healthy:
                log.info("%s instance %s is healthy", self.role, self.url)
            else:
                log.warning("%s instance %s is unhealthy: %s", self.role, self.url, error)
        self.health = new
        self.last_error = error
        self.checked_at = time.monotonic()

    def status(self) -> InstanceStatus:
        ago = None if self.checked_at is None else round(time.monotonic() - self.checked_at, 3)
        return InstanceStatus(
            url=self.url,
            healthy=self.healthy,
            health=self.health,
            outstanding=self.outstanding,
            served=self.served,
            last_error=self.last_error,
            checked_s_ago=ago,
            tokens_in_flight=self.tokens,
            breaker=self.breaker.state,
            consecutive_failures=self.breaker.consecutive_failures,
            prefix_blocks=None if self.index is None else len(self.index),
        )


class Lease:
    """One request in flight on an instance, counted until ``release`` (idempotent)."""

    def __init__(
        self,
        instance: Instance,
        tokens: int = 0,
        pick: Pick | None = None,
        chain: Sequence[int] = (),
    ) -> None:
        self.instance = instance
        self.tokens = tokens
        self.pick = pick
        self.chain = chain if instance.in_flight is not None else ()
        if instance.in_flight is not None:
            instance.in_flight.add(self.chain)
        self._held = True
        self._settled = False
        self._trial = instance.breaker.take()
        instance.outstanding += 1
        instance.tokens += tokens
        instance.served += 1

    @property
    def url(self) -> str:
        return self.instance.url

    def settle(self, ok: bool | None, why: str = "") -> None:
        """Tell the instance's breaker how the request went (first verdict only; None: no
        verdict, e.g. the client left)."""
        if ok is None or self._settled:
            return
        self._settled = True
        if ok:
            self.instance.breaker.success()
        else:
            self.instance.breaker.failure(why)

    def release(self) -> None:
        if self._held:
            self._held = False
            self.instance.outstanding -= 1
            self.instance.tokens -= self.tokens
            if self.instance.in_flight is not None:
                self.instance.in_flight.remove(self.chain)
            if self._trial and not self._settled:
                self.instance.breaker.abandon_trial()


@dataclass(frozen=True)
class Routing:
    """A pool's pick settings (README, "Routing")."""

    policy: Policy
    breaker: BreakerSettings = field(default_factory=BreakerSettings)
    alpha: float = 1.0  # cache_aware: weight of a token in flight
    index_blocks: int = 10_000  # blocks kept per instance's prefix index
    # A prefix index per instance with any policy (decode: conditional disaggregation).
    track_prefixes: bool = False


_EMPTY = RequestShape(prompt_tokens=0, max_tokens=0, chain=(), block_size=1)


@dataclass(frozen=True)
class _Hit:
    """One instance's hit for a prompt and where it came from (precise.py)."""

    tokens: int
    source: str  # KV_EVENTS, IN_FLIGHT or APPROXIMATE
    groups: dict[str, int] | None = None
    limited_by: str | None = None
    note: str | None = None  # why approximate, for an instance that publishes events


class Pool:
    """The instances of one role; picks only available ones, rotating among equals."""

    def __init__(
        self,
        role: str,
        urls: Sequence[str],
        routing: Routing | Policy = Policy.ROUND_ROBIN,
        engine_hits: EngineHits | None = None,
    ) -> None:
        self.role = role
        # Precise hits from the instances' KV events; the prefix index stays the fallback. A
        # pool none of whose instances is followed has none (nothing to look up per pick).
        followed = engine_hits is not None and any(engine_hits.follows(u) for u in urls)
        self.engine_hits = engine_hits if followed else None
        self.routing = routing if isinstance(routing, Routing) else Routing(routing)
        self.policy = self.routing.policy
        cache = self.policy is Policy.CACHE_AWARE or self.routing.track_prefixes
        self.instances = [
            Instance(
                url,
                role,
                Breaker(f"{role} instance {url}", self.routing.breaker),
                PrefixIndex(self.routing.index_blocks) if cache else None,
                InFlightPrefixes() if self.engine_hits and self.engine_hits.follows(url) else None,
            )
            for url in urls
        ]
        self.last_pick: Pick | None = None
        self._next = 0

    def pick(self, shape: RequestShape = _EMPTY, pool: PoolAnswer | None = None) -> Instance:
        """The instance the policy picks now (raises ``NoHealthyInstance``)."""
        return self._choose(shape, pool)[0]

    def _choose(
        self, shape: RequestShape, pool: PoolAnswer | None, exclude: frozenset[str] = frozenset()
    ) -> tuple[Instance, Pick]:
        n = len(self.instances)
        # Start after the last pick: round-robin takes the first available one, and min()
        # and max() keep the first of equals, so ties rotate too.
        order = [self.instances[(self._next + i) % n] for i in range(n)]
        live = [inst for inst in order if inst.available and inst.url not in exclude]
        if not live:
            tried = ", ".join(inst.url for inst in self.instances)
            opened = [i.url for i in self.instances if i.healthy and not i.breaker.allows]
            why = f"; circuit open: {', '.join(opened)}" if opened else ""
            if exclude:
                why += f"; already failed this request: {', '.join(sorted(exclude))}"
            raise NoHealthyInstance(f"no healthy {self.role} instance (tried: {tried}{why})")
        # Hits of every candidate when the pick reads them; else of the chosen one only.
        reads_hits = self.policy is Policy.CACHE_AWARE or self.engine_hits is not None
        hits = self._hits(live, shape) if reads_hits else {}
        if self.policy is Policy.LEAST_OUTSTANDING:
            chosen = min(live, key=lambda inst: inst.outstanding)
        elif self.policy is Policy.TOKENS:
            # Tokens in flight, less what the instance holds of this prompt (events only:
            # the guess is not trusted to steer decode).
            chosen = min(live, key=lambda i: i.tokens - _held(hits.get(i.url)))
        elif self.policy is Policy.CACHE_AWARE:
            chosen = max(live, key=lambda i: self._score(_weigh(hits[i.url], pool)[0], i))
        else:
            chosen = live[0]
        self._next = self.instances.index(chosen) + 1
        if not reads_hits:
            hits = self._hits([chosen], shape)
        hit = hits.get(chosen.url)
        scored = self.policy is Policy.CACHE_AWARE and hit is not None
        weighed, tier = _weigh(hit, pool) if hit is not None else (0.0, None)
        cost = shape.cost(self.role)
        if scored:
            # The load this request adds is what is left to compute of it: a prompt whose
            # prefix the instance holds weighs its suffix, not its whole length.
            cost = max(1, cost - int(weighed))
        pick = Pick(
            url=chosen.url,
            policy=self.policy.value,
            prompt_tokens=shape.prompt_tokens,
            cost_tokens=cost,
            tokens_in_flight=chosen.tokens,
            outstanding=chosen.outstanding,
            hit_tokens=None if hit is None else hit.tokens,
            score=self._score(weighed, chosen) if scored else None,
            hit_source=None if hit is None else hit.source,
            hit_groups=None if hit is None else hit.groups,
            hit_limited_by=None if hit is None else hit.limited_by,
            hit_note=None if hit is None else hit.note,
            pool_hit_tokens=None if pool is None else pool.tokens,
            hit_tier=None if pool is None or hit is None else tier,
            pool_note=None if pool is None else pool.note,
        )
        self.last_pick = pick
        return chosen, pick

    def _hits(self, insts: Sequence[Instance], shape: RequestShape) -> dict[str, _Hit]:
        """Each instance's hit: from its KV events when they answer, else its prefix index
        (instances with neither have none)."""
        answers = (
            {}
            if self.engine_hits is None
            else self.engine_hits.answer(shape, [i.url for i in insts])
        )
        out: dict[str, _Hit] = {}
        for inst in insts:
            a = answers.get(inst.url)
            if isinstance(a, PreciseHit):
                out[inst.url] = _precise(a, inst, shape)
            elif inst.index is not None:
                blocks = inst.index.hit_blocks(shape.chain)
                why = None if a is None else a.why
                out[inst.url] = _Hit(blocks * shape.block_size, APPROXIMATE, note=why)
        return out

    def _score(self, hit_tokens: float, inst: Instance) -> float:
        return cache_score(hit_tokens, inst.tokens, self.routing.alpha)

    def acquire(
        self,
        shape: RequestShape = _EMPTY,
        pool: PoolAnswer | None = None,
        exclude: frozenset[str] = frozenset(),
    ) -> Lease:
        """Pick an instance and count a request on it (raises ``NoHealthyInstance``);
        ``pool``: what the shared KV pool serves of the prompt (the second tier); ``exclude``:
        instances not to pick (a retry's, which failed this request).

        With a prefix index (cache_aware, or ``track_prefixes``), the prompt's blocks join the
        picked instance's index, since it is about to compute (or receive, or already holds)
        them."""
        inst, pick = self._choose(shape, pool, exclude)
        if inst.index is not None:
            inst.index.add(shape.chain)
        return Lease(inst, pick.cost_tokens, pick, shape.chain)

    def first_healthy(self) -> Instance:
        """The first healthy instance whose breaker is not open (for ``/v1/models``)."""
        for inst in self.instances:
            if inst.healthy and inst.breaker.state is not BreakerState.OPEN:
                return inst
        tried = ", ".join(inst.url for inst in self.instances)
        raise NoHealthyInstance(f"no healthy {self.role} instance (tried: {tried})")

    @property
    def any_available(self) -> bool:
        """Some instance may be picked now (what ``acquire`` needs)."""
        return any(inst.available for inst in self.instances)

    @property
    def any_healthy(self) -> bool:
        """Some instance is healthy with its breaker not open (a half-open one counts)."""
        return any(
            inst.healthy and inst.breaker.state is not BreakerState.OPEN for inst in self.instances
        )


def _precise(a: PreciseHit, inst: Instance, shape: RequestShape) -> _Hit:
    """The events' hit, or more where a request in flight there shares more of the prompt:
    its blocks are stored once its prefill step ends, and the events say so only then. Whole
    engine blocks only, the last prompt token excluded, full-attention engines only."""
    hit = _Hit(a.tokens, KV_EVENTS, a.groups, a.limited_by)
    if inst.in_flight is None or not a.full_attention_only:
        return hit
    block = a.block_size or shape.block_size
    shared = inst.in_flight.hit_blocks(shape.chain) * shape.block_size
    pending = min(shared, max(shape.prompt_tokens - 1, 0)) // block * block
    if pending <= a.tokens:
        return hit
    note = f"a request in flight there shares {pending} tokens; events say {a.tokens}"
    return _Hit(pending, IN_FLIGHT, a.groups, a.limited_by, note)


def _weigh(hit: _Hit, pool: PoolAnswer | None) -> tuple[float, str | None]:
    """The hit the score counts: the instance's own, raised by what the pool would load."""
    return (float(hit.tokens), None) if pool is None else pool.weigh(hit.tokens)


def _held(hit: _Hit | None) -> int:
    return hit.tokens if hit is not None and hit.source in (KV_EVENTS, IN_FLIGHT) else 0


def is_connection_failure(e: httpx.HTTPError) -> bool:
    """The instance could not be reached at all (as opposed to answering slowly or badly)."""
    return isinstance(e, httpx.ConnectError | httpx.ConnectTimeout)


class HealthChecker:
    """Polls every instance's ``GET /health``; anything but a 200 in time is unhealthy."""

    def __init__(
        self, pools: Sequence[Pool], client: httpx.AsyncClient, interval_s: float, timeout_s: float
    ) -> None:
        self.pools = pools
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s

    async def probe(self, inst: Instance) -> None:
        try:
            # The server's health: vLLM answers it for all of its DP ranks.
            r = await self.client.get(f"{upstream(inst.url)[0]}/health", timeout=self.timeout_s)
        except httpx.HTTPError as e:
            inst.mark(False, f"GET /health failed: {type(e).__name__}: {e}")
            return
        if r.status_code == 200:
            inst.mark(True)
        else:
            inst.mark(False, f"GET /health answered {r.status_code}")

    async def probe_all(self) -> None:
        # Concurrently, so one instance that hangs costs one timeout, not one per instance.
        await asyncio.gather(*(self.probe(i) for p in self.pools for i in p.instances))

    async def run(self) -> None:
        """Probe forever, ``interval_s`` apart (the caller probed once before serving)."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.probe_all()

    async def probe_breaker(self, inst: Instance) -> None:
        """An open breaker's health probe: 200 lets one request through (half-open).

        It is a health probe too: an instance found unreachable by a request is healthy
        again from here, not only at the next ``interval_s``."""
        await self.probe(inst)
        inst.breaker.probed(inst.healthy, inst.last_error or "")

    async def run_breakers(self, tick_s: float) -> None:
        """Probe each open breaker once its probe interval passed, checking every ``tick_s``."""
        while True:
            await asyncio.sleep(tick_s)
            due = [i for p in self.pools for i in p.instances if i.breaker.probe_due()]
            await asyncio.gather(*(self.probe_breaker(i) for i in due))
