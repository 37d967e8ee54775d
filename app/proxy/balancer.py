"""Instance pools per role: health, requests in flight, and the pick policy."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import httpx

from app.proxy.config import Policy
from app.proxy.errors import NoHealthyInstance

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


@dataclass
class Instance:
    """One vLLM instance's live state, changed by probes, failures and leases."""

    url: str
    role: str
    health: Health = Health.UNKNOWN
    outstanding: int = 0
    served: int = 0
    last_error: str | None = None
    checked_at: float | None = None

    @property
    def healthy(self) -> bool:
        return self.health is Health.HEALTHY

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
        )


class Lease:
    """One request in flight on an instance, counted until ``release`` (idempotent)."""

    def __init__(self, instance: Instance) -> None:
        self.instance = instance
        self._held = True
        instance.outstanding += 1
        instance.served += 1

    @property
    def url(self) -> str:
        return self.instance.url

    def release(self) -> None:
        if self._held:
            self._held = False
            self.instance.outstanding -= 1


class Pool:
    """The instances of one role; picks only healthy ones, rotating among equals."""

    def __init__(self, role: str, urls: Sequence[str], policy: Policy) -> None:
        self.role = role
        self.policy = policy
        self.instances = [Instance(url, role) for url in urls]
        self._next = 0

    def pick(self) -> Instance:
        n = len(self.instances)
        # Start after the last pick: round-robin takes the first healthy one, and
        # least-outstanding's min() keeps the first of equals, so ties rotate too.
        order = [self.instances[(self._next + i) % n] for i in range(n)]
        live = [inst for inst in order if inst.healthy]
        if not live:
            tried = ", ".join(inst.url for inst in self.instances)
            raise NoHealthyInstance(f"no healthy {self.role} instance (tried: {tried})")
        if self.policy is Policy.LEAST_OUTSTANDING:
            chosen = min(live, key=lambda inst: inst.outstanding)
        else:
            chosen = live[0]
        self._next = self.instances.index(chosen) + 1
        return chosen

    def acquire(self) -> Lease:
        """Pick an instance and count a request on it (raises ``NoHealthyInstance``)."""
        return Lease(self.pick())

    def first_healthy(self) -> Instance:
        for inst in self.instances:
            if inst.healthy:
                return inst
        tried = ", ".join(inst.url for inst in self.instances)
        raise NoHealthyInstance(f"no healthy {self.role} instance (tried: {tried})")

    @property
    def any_healthy(self) -> bool:
        return any(inst.healthy for inst in self.instances)


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
            r = await self.client.get(f"{inst.url}/health", timeout=self.timeout_s)
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
