"""Port files: how a server told to listen on port 0 tells whoever started it what it bound.

A launcher that picks a "free" port and passes it on races every other process on the host
(the port can be taken between the pick and the bind). Instead the server binds port 0, lets
the OS choose, and writes the ports it got to a small JSON file, e.g.
``{"admin_port": 41873, "control_port": 39511}``. The file is written to a temporary name
beside it and renamed over it, so a reader never sees a half-written file.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

from app.errors import ConfigError, DeadlineExceeded

__all__ = ["clear_port_file", "read_port_file", "wait_port_file", "write_port_file"]


def write_port_file(path: Path, ports: Mapping[str, int]) -> None:
    """Write ``ports`` as JSON to ``path`` atomically (a temporary file renamed over it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(dict(ports), sort_keys=True) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def clear_port_file(path: Path) -> None:
    """Remove ``path`` if present: a file left by an earlier run must not be read as ours."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def read_port_file(path: Path) -> dict[str, int] | None:
    """The ports in ``path``, or None while it does not exist yet."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ConfigError(f"port file {path} is not readable JSON: {e}") from e
    if not isinstance(data, dict) or not all(
        isinstance(v, int) and 0 < v < 65536 for v in data.values()
    ):
        raise ConfigError(f"port file {path} should map names to ports, got {data!r}")
    return {str(k): int(v) for k, v in data.items()}


def wait_port_file(
    path: Path,
    keys: Collection[str],
    timeout_s: float,
    *,
    check: Callable[[], None] | None = None,
    poll_s: float = 0.05,
) -> dict[str, int]:
    """Wait until ``path`` holds every port in ``keys``; ``check`` raises if the writer died."""
    deadline = time.monotonic() + timeout_s
    while True:
        ports = read_port_file(path)
        if ports is not None and all(k in ports for k in keys):
            return ports
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise DeadlineExceeded(f"no ports {sorted(keys)} in {path} within {timeout_s:g}s")
        time.sleep(poll_s)
