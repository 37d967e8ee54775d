"""``kv-sidecar proxy``: the decode-first router over vLLM prefill and decode instances."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated

import typer
import uvicorn

from app.errors import ConfigError
from app.ports import clear_port_file, write_port_file
from app.proxy import Flow, Policy, ProxyConfig, create_proxy
from app.proxy.config import (
    ADMIN_TOKEN_ENV,
    ADMIN_TOKEN_FLAG,
    DECODE_SIDECAR_FLAG,
    DECODE_SIDECAR_TOKEN_ENV,
    DECODE_SIDECAR_TOKEN_FLAG,
    KV_EVENTS_FLAG,
    POOL_TOKEN_ENV,
    POOL_TOKEN_FLAG,
    WithoutPrefill,
    parse_decode_sidecar,
    parse_kv_events,
)

log = logging.getLogger(__name__)

# Every flag that sets a ProxyConfig field reads its default from here: written once.
_DEFAULTS = ProxyConfig(("http://p",), ("http://d",), "http://proxy")


class _ProxyServer(uvicorn.Server):
    """uvicorn that calls ``on_started`` once it serves and ``on_stopped`` once it stopped
    (to write and remove the port file; uvicorn re-raises SIGTERM after its shutdown, so code
    after ``run`` never runs then)."""

    def __init__(
        self, config: uvicorn.Config, on_started: Callable[[], None], on_stopped: Callable[[], None]
    ) -> None:
        super().__init__(config)
        self._on_started, self._on_stopped = on_started, on_stopped

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self._on_started()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().shutdown(sockets=sockets)
        finally:
            self._on_stopped()


def _bind(host: str, port: int) -> socket.socket:
    """Listen before anything else, so that port 0 is resolved for the default public URL."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as e:
        raise ConfigError(f"the proxy cannot listen on {host}:{port}: {e.strerror or e}") from e


def read_token(path: Path | None, env: Mapping[str, str], env_var: str, flag: str) -> str | None:
    """A token from ``path`` (a mounted Secret, given by ``flag``) or ``env[env_var]``; None
    when neither is set."""
    from_env = env.get(env_var) or None
    if path is None:
        return from_env
    if from_env is not None:
        raise ConfigError(
            f"{flag} and {env_var} are both set: set one, so that which token is used is never "
            "a guess"
        )
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{flag} {str(path)!r}: cannot read it: {e}") from e
    if not token:
        raise ConfigError(f"{flag} {str(path)!r} is empty: expected the token")
    return token


def read_admin_token(path: Path | None, env: Mapping[str, str]) -> str | None:
    """The admin token from ``path`` or ``env``; None when neither is set."""
    return read_token(path, env, ADMIN_TOKEN_ENV, ADMIN_TOKEN_FLAG)


def proxy_command(
    prefill: Annotated[
        list[str], typer.Option("--prefill", help="Prefill vLLM base URL (repeatable).")
    ],
    decode: Annotated[
        list[str], typer.Option("--decode", help="Decode vLLM base URL (repeatable).")
    ],
    host: Annotated[str, typer.Option(help="Bind host.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Bind port; 0: any free one (see --port-file).")] = 8000,
    port_file: Annotated[
        Path | None,
        typer.Option(help='Once serving, write {"port": N} here as JSON (for --port 0).'),
    ] = None,
    prefill_policy: Annotated[
        Policy,
        typer.Option(
            help="cache_aware (prompt blocks already routed there minus --prefill-alpha x "
            "tokens in flight), round_robin or least_outstanding (README, Routing)."
        ),
    ] = _DEFAULTS.prefill_policy,
    decode_policy: Annotated[
        Policy,
        typer.Option(
            help="tokens (fewest prompt + max_tokens in flight), round_robin or least_outstanding."
        ),
    ] = _DEFAULTS.decode_policy,
    policy: Annotated[
        Policy | None,
        typer.Option(help="round_robin or least_outstanding for both roles (overrides both)."),
    ] = _DEFAULTS.policy,
    prefill_alpha: Annotated[
        float,
        typer.Option(help="cache_aware: weight of a token in flight against a cached token."),
    ] = _DEFAULTS.prefill_alpha,
    prefix_block_size: Annotated[
        int, typer.Option(help="cache_aware: prompt tokens per hashed block.")
    ] = _DEFAULTS.prefix_block_size,
    prefix_index_blocks: Annotated[
        int,
        typer.Option(
            help="Blocks remembered per instance (LRU): cache_aware prefill, and decode for "
            "--decode-hit-fraction."
        ),
    ] = _DEFAULTS.prefix_index_blocks,
    min_prefill_tokens: Annotated[
        int,
        typer.Option(
            help="A prompt shorter than this goes to decode alone, no prefill (0: never)."
        ),
    ] = _DEFAULTS.min_prefill_tokens,
    decode_hit_fraction: Annotated[
        float,
        typer.Option(
            help="A prompt of which the picked decode holds at least this fraction (blocks the "
            "proxy routed there before) goes to decode alone (above 1: never)."
        ),
    ] = _DEFAULTS.decode_hit_fraction,
    without_prefill: Annotated[
        WithoutPrefill,
        typer.Option(
            help="A prompt that needs a prefill when no prefill instance is available: "
            "decode_alone (decode computes it; counted in kvproxy_prefill_unavailable_total) "
            "or refuse (503)."
        ),
    ] = _DEFAULTS.without_prefill,
    breaker_failures: Annotated[
        int,
        typer.Option(
            help="Consecutive failures (connection, transport, 5xx) that take an instance out."
        ),
    ] = _DEFAULTS.breaker_failures,
    breaker_probe_interval: Annotated[
        float,
        typer.Option(
            help="Seconds before an instance taken out is probed (GET /health, then one request)."
        ),
    ] = _DEFAULTS.breaker_probe_interval_s,
    flow: Annotated[
        Flow,
        typer.Option(
            help="concurrent: the prompt goes to prefill and decode at once; decode_first: to "
            "prefill once decode posted its target."
        ),
    ] = _DEFAULTS.flow,
    public_url: Annotated[
        str | None,
        typer.Option(
            help="URL at which the engines reach this proxy's /v1/kv_targets "
            "(default http://HOST:PORT)."
        ),
    ] = None,
    target_timeout: Annotated[
        float,
        typer.Option(
            help="Seconds prefill (or, decode first, the proxy) waits for decode's target."
        ),
    ] = _DEFAULTS.target_timeout_s,
    request_timeout: Annotated[
        float,
        typer.Option(help="Seconds an upstream may take per read (a whole non-streamed answer)."),
    ] = _DEFAULTS.request_timeout_s,
    health_interval: Annotated[
        float, typer.Option(help="Seconds between health probes of each instance.")
    ] = _DEFAULTS.health_interval_s,
    max_body_bytes: Annotated[
        int, typer.Option(help="Largest request body read (413 past it).")
    ] = _DEFAULTS.max_body_bytes,
    max_inflight: Annotated[
        int, typer.Option(help="Requests in flight before 503 with Retry-After.")
    ] = _DEFAULTS.max_inflight,
    max_model_len: Annotated[
        int,
        typer.Option(help="Longest sequence the engines serve (caps max_tokens in routing)."),
    ] = _DEFAULTS.max_model_len,
    admin_token_file: Annotated[
        Path | None,
        typer.Option(
            help="File holding the bearer token GET /v1/transfers needs (else the token in "
            f"{ADMIN_TOKEN_ENV}; with neither, only loopback clients may read transfers)."
        ),
    ] = None,
    kv_events: Annotated[
        list[str] | None,
        typer.Option(
            KV_EVENTS_FLAG,
            help="URL=ENDPOINT[,REPLAY]: follow the KV events the instance at URL publishes "
            "(its --kv-events-config endpoints as reached from here) and route by what it "
            "really holds (repeatable; README, Routing by KV events).",
        ),
    ] = None,
    kv_events_unit: Annotated[
        int,
        typer.Option(help="Tokens per key step of the KV-event index: divides every block size."),
    ] = _DEFAULTS.kv_events_unit,
    kv_events_max_blocks: Annotated[
        int,
        typer.Option(
            help="Blocks the KV-event index keeps per instance; past it the instance is scored "
            "by the prefix index until the engine clears or restarts."
        ),
    ] = _DEFAULTS.kv_events_max_blocks,
    pool_lookup: Annotated[
        str | None,
        typer.Option(
            help="Admin URL of a sidecar of the shared KV pool: each prefill pick asks it how "
            "much of the prompt the pool serves, its second tier (README, Routing by KV events)."
        ),
    ] = None,
    pool_load_cost: Annotated[
        float,
        typer.Option(
            help="What loading one token from the pool costs, in computed tokens (0 to 1)."
        ),
    ] = _DEFAULTS.pool_load_cost,
    pool_lookup_token_file: Annotated[
        Path | None,
        typer.Option(
            POOL_TOKEN_FLAG,
            help="File holding the pool sidecars' admin token, sent with each pool lookup "
            f"(else the token in {POOL_TOKEN_ENV}); the lookup needs it when they have one.",
        ),
    ] = None,
    decode_sidecar: Annotated[
        list[str] | None,
        typer.Option(
            DECODE_SIDECAR_FLAG,
            help="URL=ADMIN_URL[,ADMIN_URL...]: the admin API of the sidecar(s) of the decode "
            "at URL; a prefill that failed for good is aborted there at once, so decode "
            "recomputes now instead of at its deadline (repeatable; docs/serving.md).",
        ),
    ] = None,
    decode_sidecar_token_file: Annotated[
        Path | None,
        typer.Option(
            DECODE_SIDECAR_TOKEN_FLAG,
            help="File holding decode sidecars' admin token, sent with those aborts (else the "
            f"token in {DECODE_SIDECAR_TOKEN_ENV}); they need it when the sidecars have one.",
        ),
    ] = None,
    retry_budget_ratio: Annotated[
        float,
        typer.Option(help="Retries allowed per request seen over the budget's window (0 to 1)."),
    ] = _DEFAULTS.retry_budget_ratio,
    retry_budget_min: Annotated[
        int,
        typer.Option(help="Retries allowed per window whatever the ratio (ratio and min 0: none)."),
    ] = _DEFAULTS.retry_budget_min,
    retry_budget_window: Annotated[
        float, typer.Option(help="The retry budget's sliding window, in seconds.")
    ] = _DEFAULTS.retry_budget_window_s,
    migration_limit: Annotated[
        int,
        typer.Option(
            help="Times a stream whose decode breaks off after the first byte goes on from "
            "another decode with the tokens already sent (0: it ends with an error event; "
            "docs/serving.md)."
        ),
    ] = _DEFAULTS.migration_limit,
    chat_tokens: Annotated[
        bool,
        typer.Option(
            help="Render chat requests to token ids through a decode instance's /tokenize and "
            "route them as token prompts; both engines then compute on those ids "
            "(docs/serving.md, Chat requests as token ids)."
        ),
    ] = _DEFAULTS.chat_tokens,
    chat_tokens_timeout: Annotated[
        float,
        typer.Option(
            help="Seconds a /tokenize call may take before the chat request is routed as text."
        ),
    ] = _DEFAULTS.chat_tokens_timeout_s,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
) -> None:
    """Serve /v1/completions and /v1/chat/completions over P and D instances."""
    if log_level not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"--log-level {log_level!r}: expected debug, info, warning or error")
    admin_token = read_admin_token(admin_token_file, os.environ)
    pool_token = read_token(pool_lookup_token_file, os.environ, POOL_TOKEN_ENV, POOL_TOKEN_FLAG)
    sidecar_token = read_token(
        decode_sidecar_token_file, os.environ, DECODE_SIDECAR_TOKEN_ENV, DECODE_SIDECAR_TOKEN_FLAG
    )
    if port_file is not None:
        clear_port_file(port_file)  # an earlier run's port is not ours
    sock = _bind(host, port)
    port = int(sock.getsockname()[1])
    shown = f"[{host}]" if ":" in host else host
    try:
        cfg = ProxyConfig(
            prefill=tuple(prefill),
            decode=tuple(decode),
            public_url=public_url or f"http://{shown}:{port}",
            prefill_policy=prefill_policy,
            decode_policy=decode_policy,
            policy=policy,
            flow=flow,
            prefill_alpha=prefill_alpha,
            prefix_block_size=prefix_block_size,
            prefix_index_blocks=prefix_index_blocks,
            min_prefill_tokens=min_prefill_tokens,
            decode_hit_fraction=decode_hit_fraction,
            without_prefill=without_prefill,
            breaker_failures=breaker_failures,
            breaker_probe_interval_s=breaker_probe_interval,
            target_timeout_s=target_timeout,
            request_timeout_s=request_timeout,
            health_interval_s=health_interval,
            max_body_bytes=max_body_bytes,
            max_inflight=max_inflight,
            max_model_len=max_model_len,
            admin_token=admin_token,
            kv_events=tuple(parse_kv_events(spec) for spec in kv_events or ()),
            kv_events_unit=kv_events_unit,
            kv_events_max_blocks=kv_events_max_blocks,
            pool_lookup=pool_lookup,
            pool_load_cost=pool_load_cost,
            pool_lookup_token=pool_token,
            retry_budget_ratio=retry_budget_ratio,
            retry_budget_min=retry_budget_min,
            retry_budget_window_s=retry_budget_window,
            decode_sidecars=tuple(parse_decode_sidecar(spec) for spec in decode_sidecar or ()),
            decode_sidecar_token=sidecar_token,
            migration_limit=migration_limit,
            chat_tokens=chat_tokens,
            chat_tokens_timeout_s=chat_tokens_timeout,
        )
    except ConfigError:
        sock.close()
        raise
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    def started() -> None:
        log.info("proxy listening on http://%s:%d", shown, port)
        if port_file is not None:
            write_port_file(port_file, {"port": port})

    def stopped() -> None:
        if port_file is not None:
            clear_port_file(port_file)  # nothing listens on that port any more

    server = _ProxyServer(
        uvicorn.Config(create_proxy(cfg), log_level=log_level, access_log=log_level == "debug"),
        started,
        stopped,
    )
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        stopped()  # also when startup failed
