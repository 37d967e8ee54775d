"""The multi-tenant workload of ``bench routing``: who asks what, and when (pure, seeded).

Each tenant has a system prompt of its own; each request is its tenant's system prompt plus a
suffix of its own. Arrivals are a Poisson process at ``rate_per_s`` with one burst: at
``burst_at`` (a fraction of the requests) ``burst`` requests arrive at once. Tenants are drawn
with Zipf-like weights (tenant ``k`` with weight ``1 / (k + 1) ** skew``), as a few tenants
usually dominate; ``skew = 0`` draws them evenly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from app.bench.core.workload import random_tokens
from app.errors import ConfigError


@dataclass(frozen=True)
class Workload:
    tenants: int = 8
    system_tokens: int = 512
    suffix_tokens: int = 64
    requests: int = 64
    rate_per_s: float = 4.0
    burst: int = 8
    burst_at: float = 0.5
    skew: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("tenants", "system_tokens", "suffix_tokens", "requests"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.rate_per_s > 0:
            raise ConfigError(f"rate_per_s must be positive, got {self.rate_per_s}")
        if not 0 <= self.burst <= self.requests:
            raise ConfigError(f"burst must be 0..requests ({self.requests}), got {self.burst}")
        if not 0 <= self.burst_at <= 1 or self.skew < 0:
            raise ConfigError(
                f"expected burst_at in [0, 1] and skew >= 0; got {self.burst_at}, {self.skew}"
            )


@dataclass(frozen=True)
class Arrival:
    """One request: when it is sent (seconds from the start), whose it is, its prompt, and
    whether it is one of the burst's."""

    at_s: float
    tenant: int
    tokens: tuple[int, ...]
    burst: bool = False


def system_prompt(w: Workload, tenant: int) -> tuple[int, ...]:
    """Tenant ``tenant``'s system prompt (the same in every run with this seed)."""
    rng = random.Random(f"{w.seed}/system/{tenant}")
    return random_tokens(rng, w.system_tokens)


def arrivals(w: Workload) -> list[Arrival]:
    """Every request of the workload in arrival order."""
    rng = random.Random(f"{w.seed}/arrivals")
    systems = [system_prompt(w, t) for t in range(w.tenants)]
    weights = [1 / (k + 1) ** w.skew for k in range(w.tenants)]
    burst_start = round(w.burst_at * (w.requests - w.burst))
    out: list[Arrival] = []
    t = 0.0
    for i in range(w.requests):
        # The burst's requests share the arrival time of its first.
        if not (burst_start < i < burst_start + w.burst):
            t += rng.expovariate(w.rate_per_s)
        tenant = rng.choices(range(w.tenants), weights)[0]
        suffix = random_tokens(rng, w.suffix_tokens)
        burst = burst_start <= i < burst_start + w.burst
        out.append(Arrival(t, tenant, systems[tenant] + suffix, burst))
    return out
