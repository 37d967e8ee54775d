"""``kv-sidecar proxy``: the decode-first router over vLLM prefill and decode instances."""

from __future__ import annotations

from typing import Annotated

import typer
import uvicorn

from app.errors import ConfigError
from app.proxy import ProxyConfig, create_proxy


def proxy_command(
    prefill: Annotated[list[str], typer.Option(help="Prefill vLLM base URL (repeatable).")],
    decode: Annotated[list[str], typer.Option(help="Decode vLLM base URL (repeatable).")],
    host: Annotated[str, typer.Option(help="Bind host.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Bind port.")] = 8000,
    policy: Annotated[str, typer.Option(help="round_robin or least_outstanding.")] = "round_robin",
    public_url: Annotated[
        str | None, typer.Option(help="URL engines reach this proxy at (default from host/port).")
    ] = None,
    target_timeout: Annotated[
        float, typer.Option(help="Seconds to wait for decode's target.")
    ] = 30.0,
) -> None:
    """Serve /v1/completions and /v1/chat/completions over P and D instances."""
    if policy not in ("round_robin", "least_outstanding"):
        raise ConfigError(f"--policy {policy!r}: expected round_robin or least_outstanding")
    cfg = ProxyConfig(
        prefill=prefill,
        decode=decode,
        public_url=(public_url or f"http://{host}:{port}").rstrip("/"),
        policy=policy,
        target_timeout_s=target_timeout,
    )
    uvicorn.run(create_proxy(cfg), host=host, port=port, log_level="warning")
