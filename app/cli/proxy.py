"""``kv-sidecar proxy``: the decode-first router over vLLM prefill and decode instances."""

from __future__ import annotations

import logging
from typing import Annotated

import typer
import uvicorn

from app.errors import ConfigError
from app.proxy import Policy, ProxyConfig, create_proxy


def proxy_command(
    prefill: Annotated[
        list[str], typer.Option("--prefill", help="Prefill vLLM base URL (repeatable).")
    ],
    decode: Annotated[
        list[str], typer.Option("--decode", help="Decode vLLM base URL (repeatable).")
    ],
    host: Annotated[str, typer.Option(help="Bind host.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Bind port.")] = 8000,
    policy: Annotated[
        Policy, typer.Option(help="How an instance is picked among the healthy ones.")
    ] = Policy.ROUND_ROBIN,
    public_url: Annotated[
        str | None,
        typer.Option(
            help="URL at which the engines reach this proxy's /v1/kv_targets "
            "(default http://HOST:PORT)."
        ),
    ] = None,
    target_timeout: Annotated[
        float, typer.Option(help="Seconds to wait for decode's target before giving up on P.")
    ] = 30.0,
    request_timeout: Annotated[
        float,
        typer.Option(help="Seconds an upstream may take per read (a whole non-streamed answer)."),
    ] = 600.0,
    health_interval: Annotated[
        float, typer.Option(help="Seconds between health probes of each instance.")
    ] = 5.0,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
) -> None:
    """Serve /v1/completions and /v1/chat/completions over P and D instances, decode first."""
    if log_level not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"--log-level {log_level!r}: expected debug, info, warning or error")
    cfg = ProxyConfig(
        prefill=tuple(prefill),
        decode=tuple(decode),
        public_url=public_url or f"http://{host}:{port}",
        policy=policy,
        target_timeout_s=target_timeout,
        request_timeout_s=request_timeout,
        health_interval_s=health_interval,
    )
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    uvicorn.run(
        create_proxy(cfg),
        host=host,
        port=port,
        log_level=log_level,
        access_log=log_level == "debug",
    )
