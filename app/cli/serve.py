"""``kv-sidecar serve``: one sidecar process from settings (flags > env > config file)."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from app.config import load_settings


def serve_command(
    role: Annotated[str | None, typer.Option(help="prefill, decode or both.")] = None,
    engine_id: Annotated[str | None, typer.Option(help="This sidecar's engine id.")] = None,
    ranks: Annotated[str | None, typer.Option(help="Engine ranks hosted, e.g. 0,1.")] = None,
    tp_size: Annotated[int | None, typer.Option(help="TP size of the instance.")] = None,
    control_host: Annotated[str | None, typer.Option(help="Control port bind host.")] = None,
    control_port: Annotated[int | None, typer.Option(help="Peer control port.")] = None,
    engine_ipc: Annotated[str | None, typer.Option(help="Engine link endpoint.")] = None,
    admin_host: Annotated[str | None, typer.Option(help="Admin API bind host.")] = None,
    admin_port: Annotated[int | None, typer.Option(help="Admin API port.")] = None,
    transport: Annotated[str | None, typer.Option(help="tcp or rdma.")] = None,
    port_file: Annotated[
        Path | None,
        typer.Option(help="Write the bound admin and control ports here as JSON (for port 0)."),
    ] = None,
    config: Annotated[Path | None, typer.Option(help="TOML or JSON config file.")] = None,
) -> None:
    """Run a sidecar until SIGTERM/SIGINT."""
    flags = {
        "role": role,
        "engine_id": engine_id,
        "ranks": ranks,
        "tp_size": tp_size,
        "control_host": control_host,
        "control_port": control_port,
        "engine_ipc": engine_ipc,
        "admin_host": admin_host,
        "admin_port": admin_port,
        "transport": transport,
        "port_file": port_file,
    }
    settings = load_settings(flags, config)
    from app.service import serve  # inside the command: see app/cli/main.py

    code = asyncio.run(serve(settings))
    # Every resource was released by the shutdown above (the engine, the pool, the sockets,
    # the spans exported); the interpreter's own teardown, a last garbage collection over every
    # module, only delayed the exit by half a second, which a rolling restart waits for.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
