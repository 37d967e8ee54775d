"""The proxy's settings, one frozen value built by the CLI (or a test)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from app.errors import ConfigError
from app.proxy.chat_tokens import ChatTokenSettings
from app.proxy.disagg import DisaggRules
from app.proxy.dp import upstream
from app.proxy.kv_events.feed import EngineEvents
from app.proxy.retries import BudgetSettings

# Where ``kv-sidecar proxy`` reads the admin token when no --admin-token-file is given.
ADMIN_TOKEN_ENV = "KVSIDECAR_PROXY_ADMIN_TOKEN"
ADMIN_TOKEN_FLAG = "--admin-token-file"
# The bearer token the proxy sends with POST /v1/pool/lookup: the pool sidecars' admin token
# (KVSIDECAR_ADMIN_TOKEN there), which the lookup needs when they have one.
POOL_TOKEN_ENV = "KVSIDECAR_PROXY_POOL_LOOKUP_TOKEN"
POOL_TOKEN_FLAG = "--pool-lookup-token-file"
# The bearer token the proxy sends with an abort to decode's sidecar (its admin token).
DECODE_SIDECAR_TOKEN_ENV = "KVSIDECAR_PROXY_DECODE_SIDECAR_TOKEN"
DECODE_SIDECAR_TOKEN_FLAG = "--decode-sidecar-token-file"
DECODE_SIDECAR_FLAG = "--decode-sidecar"


class Policy(StrEnum):
    """How an instance is picked among the healthy ones of a role."""

    ROUND_ROBIN = "round_robin"
    LEAST_OUTSTANDING = "least_outstanding"
    # Fewest tokens in flight (prompt + max_tokens of the requests it serves).
    TOKENS = "tokens"
    # Most prompt tokens already routed there, minus alpha x tokens in flight (routing.py).
    CACHE_AWARE = "cache_aware"


# What each role may use, the default first.
PREFILL_POLICIES = (Policy.CACHE_AWARE, Policy.ROUND_ROBIN, Policy.LEAST_OUTSTANDING)
DECODE_POLICIES = (Policy.TOKENS, Policy.ROUND_ROBIN, Policy.LEAST_OUTSTANDING)
# --policy, the older switch for both roles at once.
SHARED_POLICIES = (Policy.ROUND_ROBIN, Policy.LEAST_OUTSTANDING)


def _policy(value: str, allowed: tuple[Policy, ...], flag: str) -> Policy:
    choices = ", ".join(p.value for p in allowed)
    try:
        p = Policy(value)
    except ValueError:
        raise ConfigError(f"{flag} {str(value)!r}: expected one of {choices}") from None
    if p not in allowed:
        raise ConfigError(f"{flag} {str(value)!r}: expected one of {choices}")
    return p


KV_EVENTS_FLAG = "--kv-events"


def parse_kv_events(spec: str) -> EngineEvents:
    """``URL=ENDPOINT[,REPLAY_ENDPOINT]``: where the instance at URL publishes its KV events
    (its ``--kv-events-config`` endpoint and replay endpoint, as this proxy reaches them)."""
    url, sep, ends = spec.partition("=")
    parts = ends.split(",")
    if not sep or not url or not parts[0] or len(parts) > 2:
        raise ConfigError(
            f"{KV_EVENTS_FLAG} {spec!r}: expected URL=ENDPOINT[,REPLAY_ENDPOINT], e.g. "
            "http://10.0.0.5:8100=tcp://10.0.0.5:5557,tcp://10.0.0.5:5558"
        )
    for end in parts:
        if not end.startswith(("tcp://", "ipc://")):
            raise ConfigError(
                f"{KV_EVENTS_FLAG} {spec!r}: endpoint {end!r} is not a ZMQ tcp:// or ipc:// address"
            )
    return EngineEvents(url.rstrip("/"), parts[0], parts[1] if len(parts) == 2 else None)


@dataclass(frozen=True)
class DecodeSidecar:
    """Where the proxy tells a decode instance's sidecar(s) to stop waiting for a transfer:
    their admin API (one per pipeline stage or pod that holds the instance's ranks)."""

    decode: str
    admin_urls: tuple[str, ...]


def parse_decode_sidecar(spec: str) -> DecodeSidecar:
    """``URL=ADMIN_URL[,ADMIN_URL...]``: the admin API of the sidecar(s) of decode at URL."""
    url, sep, ends = spec.partition("=")
    admins = tuple(a.rstrip("/") for a in ends.split(",") if a)
    if not sep or not url or not admins:
        raise ConfigError(
            f"{DECODE_SIDECAR_FLAG} {spec!r}: expected URL=ADMIN_URL[,ADMIN_URL...], e.g. "
            "http://10.0.0.6:8200=http://10.0.0.6:9100"
        )
    for a in admins:
        if not a.startswith(("http://", "https://")):
            raise ConfigError(
                f"{DECODE_SIDECAR_FLAG} {spec!r}: {a!r} is not an http(s):// admin URL"
            )
    return DecodeSidecar(url.rstrip("/"), admins)


class WithoutPrefill(StrEnum):
    """What a request that needs a prefill gets when no prefill instance can take it."""

    # Decode computes the whole prompt, as it does a short one (disagg.py).
    DECODE_ALONE = "decode_alone"
    # 503: shed the load rather than slow decode's running requests with long prompts.
    REFUSE = "refuse"


class Flow(StrEnum):
    """When the prompt goes to prefill (README, "Request flows")."""

    # Prefill and decode at once; prefill's connector fetches decode's target from the proxy.
    CONCURRENT = "concurrent"
    # Prefill only once decode posted its target.
    DECODE_FIRST = "decode_first"


@dataclass(frozen=True)
class ProxyConfig:
    """Instances, public callback address, policy and every timeout the proxy uses."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    public_url: str
    prefill_policy: Policy = Policy.CACHE_AWARE
    decode_policy: Policy = Policy.TOKENS
    # Both roles' policy at once when given (round_robin or least_outstanding).
    policy: Policy | None = None
    flow: Flow = Flow.CONCURRENT
    # Consecutive failures that open an instance's breaker; seconds until it is probed.
    breaker_failures: int = 3
    breaker_probe_interval_s: float = 5.0
    # Prefix index (cache_aware prefill, and decode for the hit rule): tokens per block,
    # blocks kept per instance.
    prefix_block_size: int = 16
    prefix_index_blocks: int = 10_000
    # Conditional disaggregation (disagg.py): a prompt shorter than this, or of which the
    # picked decode holds at least this fraction, is served by decode alone. 0 / above 1: off.
    min_prefill_tokens: int = 256
    decode_hit_fraction: float = 0.8
    # A request that needs a prefill when none is available: decode alone, or 503.
    without_prefill: WithoutPrefill = WithoutPrefill.DECODE_ALONE
    # cache_aware's weight of a token in flight against a cached prompt token.
    prefill_alpha: float = 1.0
    target_timeout_s: float = 30.0
    # Longest wait for any one read from an upstream (a whole non-streamed answer, or the
    # gap between two streamed chunks); decode waits for the KV before its first token.
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    health_interval_s: float = 5.0
    health_timeout_s: float = 3.0
    transfer_log_size: int = 1000
    # Bounds on what clients can make the proxy hold: a body (413 past it, 408 when it is not
    # whole within body_timeout_s) and requests in flight (503 with Retry-After past it).
    max_body_bytes: int = 8 << 20
    body_timeout_s: float = 30.0
    max_inflight: int = 1024
    # The longest sequence any instance serves: a request's max_tokens counts for routing up
    # to what fits after its prompt, so a huge one cannot weigh on an instance for good.
    max_model_len: int = 131_072
    # Bearer token GET /v1/transfers needs; None: only loopback clients may read them.
    admin_token: str | None = field(default=None, repr=False)
    # Instances whose own KV events the proxy follows (precise hits, README "Routing by KV
    # events"); the key unit must divide every block size they publish; blocks kept each.
    kv_events: tuple[EngineEvents, ...] = ()
    kv_events_unit: int = 16
    kv_events_max_blocks: int = 1_000_000
    # The KV pool as the prefill pick's second tier (pool_tier.py): a sidecar of the shared
    # pool asked per pick, what loading a token costs in computed tokens, and how long a
    # lookup may take before the pick goes without it.
    pool_lookup: str | None = None
    pool_load_cost: float = 0.5
    pool_lookup_timeout_s: float = 0.25
    # Sent as the lookup's bearer token: the pool sidecar's admin token (None: send none).
    pool_lookup_token: str | None = field(default=None, repr=False)
    # Retries (retries.py): at most this share of the requests of the last window, and at
    # least this many per window. Both 0: no retries.
    retry_budget_ratio: float = 0.1
    retry_budget_min: int = 3
    retry_budget_window_s: float = 10.0
    # A stream whose decode breaks off after the first byte goes on from another decode at
    # most this many times (migration.py; 0: it ends with an error event), within the budget.
    migration_limit: int = 1
    # Decode instances' sidecar admin APIs: a prefill that failed for good is told to decode's
    # sidecar at once (an abort: decode recomputes now, not at its deadline). None known:
    # decode waits for its sidecar's deadline, as before.
    decode_sidecars: tuple[DecodeSidecar, ...] = ()
    decode_sidecar_token: str | None = field(default=None, repr=False)
    # Chat requests rendered to token ids by a decode instance's /tokenize (chat_tokens.py):
    # on or off, the longest the call may take before the request is routed as text, the
    # largest messages (bytes of JSON) sent, and the cache of rendered ids (entries, ids).
    chat_tokens: bool = True
    chat_tokens_timeout_s: float = 2.0
    chat_tokens_max_bytes: int = 1 << 20
    chat_tokens_cache_entries: int = 4096
    chat_tokens_cache_tokens: int = 8_000_000

    def __post_init__(self) -> None:
        # Normalized once (tuples, no trailing slash) so paths join the same way everywhere.
        object.__setattr__(self, "prefill", tuple(u.rstrip("/") for u in self.prefill))
        object.__setattr__(self, "decode", tuple(u.rstrip("/") for u in self.decode))
        object.__setattr__(self, "public_url", self.public_url.rstrip("/"))
        if self.policy is not None:
            shared = _policy(self.policy, SHARED_POLICIES, "--policy")
            object.__setattr__(self, "policy", shared)
            object.__setattr__(self, "prefill_policy", shared)
            object.__setattr__(self, "decode_policy", shared)
        object.__setattr__(
            self,
            "prefill_policy",
            _policy(self.prefill_policy, PREFILL_POLICIES, "--prefill-policy"),
        )
        object.__setattr__(
            self, "decode_policy", _policy(self.decode_policy, DECODE_POLICIES, "--decode-policy")
        )
        try:
            object.__setattr__(self, "without_prefill", WithoutPrefill(self.without_prefill))
        except ValueError:
            choices = ", ".join(w.value for w in WithoutPrefill)
            raise ConfigError(
                f"--without-prefill {self.without_prefill!r}: expected one of {choices}"
            ) from None
        try:
            object.__setattr__(self, "flow", Flow(self.flow))
        except ValueError:
            choices = ", ".join(f.value for f in Flow)
            raise ConfigError(f"--flow {self.flow!r}: expected one of {choices}") from None
        for role, urls in (("prefill", self.prefill), ("decode", self.decode)):
            if not urls:
                raise ConfigError(f"no {role} instance: give at least one --{role} URL")
            for url in urls:
                if not url.startswith(("http://", "https://")):
                    raise ConfigError(f"--{role} {url!r}: expected an http:// or https:// URL")
                upstream(url)  # a #dp<rank> suffix, if any, names a DP rank
            if len(set(urls)) != len(urls):
                raise ConfigError(f"--{role} lists the same URL twice: {', '.join(urls)}")
        if not self.public_url.startswith(("http://", "https://")):
            raise ConfigError(f"--public-url {self.public_url!r}: expected an http(s):// URL")
        for name in (
            "target_timeout_s",
            "request_timeout_s",
            "connect_timeout_s",
            "health_interval_s",
            "health_timeout_s",
            "breaker_probe_interval_s",
            "body_timeout_s",
            "pool_lookup_timeout_s",
            "retry_budget_window_s",
            "chat_tokens_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        known = set(self.prefill) | set(self.decode)
        named = [e.name for e in self.kv_events]
        for name in named:
            if name not in known:
                raise ConfigError(
                    f"{KV_EVENTS_FLAG} names {name!r}, which is not a --prefill or --decode URL "
                    f"({', '.join(sorted(known))})"
                )
        if len(set(named)) != len(named):
            raise ConfigError(f"{KV_EVENTS_FLAG} names an instance twice: {', '.join(named)}")
        told = [s.decode for s in self.decode_sidecars]
        for name in told:
            if name not in self.decode:
                raise ConfigError(
                    f"{DECODE_SIDECAR_FLAG} names {name!r}, which is not a --decode URL "
                    f"({', '.join(self.decode)})"
                )
        if len(set(told)) != len(told):
            raise ConfigError(f"{DECODE_SIDECAR_FLAG} names an instance twice: {', '.join(told)}")
        for name in (
            "kv_events_unit",
            "kv_events_max_blocks",
            "breaker_failures",
            "prefix_block_size",
            "prefix_index_blocks",
            "max_body_bytes",
            "max_inflight",
            "max_model_len",
            "chat_tokens_max_bytes",
            "chat_tokens_cache_entries",
            "chat_tokens_cache_tokens",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.min_prefill_tokens < 0:
            raise ConfigError(
                f"min_prefill_tokens must not be negative (0 turns the rule off), "
                f"got {self.min_prefill_tokens}"
            )
        if not self.decode_hit_fraction > 0:
            raise ConfigError(
                f"decode_hit_fraction must be positive (above 1 turns the rule off), "
                f"got {self.decode_hit_fraction}"
            )
        if not 0 <= self.retry_budget_ratio <= 1:
            raise ConfigError(
                f"retry_budget_ratio must be within [0, 1] (retries per request), "
                f"got {self.retry_budget_ratio}"
            )
        if self.migration_limit < 0:
            raise ConfigError(f"migration_limit must not be negative, got {self.migration_limit}")
        if self.retry_budget_min < 0:
            raise ConfigError(f"retry_budget_min must not be negative, got {self.retry_budget_min}")
        if self.prefill_alpha < 0:
            raise ConfigError(f"prefill_alpha must not be negative, got {self.prefill_alpha}")
        if not 0 <= self.pool_load_cost <= 1:
            raise ConfigError(
                f"pool_load_cost must be within [0, 1] (0: a pool token is as good as an "
                f"engine's cached one, 1: worth nothing), got {self.pool_load_cost}"
            )
        if self.pool_lookup is not None and not self.pool_lookup.startswith(
            ("http://", "https://")
        ):
            raise ConfigError(
                f"--pool-lookup {self.pool_lookup!r}: expected the http(s):// admin URL of a "
                "sidecar of the shared KV pool"
            )
        if self.transfer_log_size < 1:
            raise ConfigError(f"transfer_log_size must be at least 1, got {self.transfer_log_size}")
        for name, source in (
            ("admin_token", f"{ADMIN_TOKEN_FLAG} or {ADMIN_TOKEN_ENV}"),
            ("pool_lookup_token", f"{POOL_TOKEN_FLAG} or {POOL_TOKEN_ENV}"),
            (
                "decode_sidecar_token",
                f"{DECODE_SIDECAR_TOKEN_FLAG} or {DECODE_SIDECAR_TOKEN_ENV}",
            ),
        ):
            token = getattr(self, name)
            if token is None:
                continue
            # Stripped as HTTP strips a header's value (a file's newline would never match).
            object.__setattr__(self, name, token.strip())
            if not getattr(self, name):
                raise ConfigError(
                    f"the {name.replace('_', ' ')} ({source}) is blank: "
                    "expected a secret, e.g. the output of "
                    "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
                )

    @property
    def disagg_rules(self) -> DisaggRules:
        return DisaggRules(self.min_prefill_tokens, self.decode_hit_fraction)

    @property
    def chat_token_settings(self) -> ChatTokenSettings:
        return ChatTokenSettings(
            self.chat_tokens_timeout_s,
            self.chat_tokens_max_bytes,
            self.chat_tokens_cache_entries,
            self.chat_tokens_cache_tokens,
        )

    @property
    def retry_budget(self) -> BudgetSettings:
        return BudgetSettings(
            self.retry_budget_ratio, self.retry_budget_min, self.retry_budget_window_s
        )

    @property
    def router_url(self) -> str:
        """Where decode's connector posts its target for a transfer."""
        return f"{self.public_url}/v1/kv_targets"
