"""Start a real ``mooncake_master`` on loopback, for tests, demos and single-host set-ups.

Facts this module relies on (mooncake-transfer-engine-non-cuda 0.3.13.post1):

* The wheel ships the binary as ``mooncake/mooncake_master``; ``.venv/bin/mooncake_master`` is a
  Python shim that ``exec``s it (same pid). The binary is used directly: no interpreter start-up.
* Every server it starts binds ``0.0.0.0`` unless told otherwise: RPC (``--rpc_address``),
  metrics/admin HTTP (``--metrics_host``) and, when enabled, the HTTP metadata server. The last one
  binds ``0.0.0.0`` *even with* ``--http_metadata_server_host=127.0.0.1`` (its log claims
  127.0.0.1; the socket says otherwise), so it is off by default here -- Mooncake Store clients
  use ``P2PHANDSHAKE`` and need no metadata server -- and ``start_master`` checks the listening
  sockets of the process and refuses a wildcard bind.
* Readiness: ``GET http://<metrics_host>:<metrics_port>/health`` answers
  ``{"service_ready": true, ...}`` about 0.1 s after start -- sometimes before the RPC port is
  bound, and even when binding it is about to fail -- so readiness here also needs the master's
  own process to listen on its RPC port (read from /proc).
* A port already in use makes it log "Address already in use" and exit; SIGTERM stops it in
  about 1 s.
"""

from __future__ import annotations

import contextlib
import importlib.util
import ipaddress
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from app.errors import PoolError

LOOPBACK = "127.0.0.1"
_START_ATTEMPTS = 3


class MasterProcess(subprocess.Popen[bytes]):
    """A running ``mooncake_master`` plus where it listens and where it logs."""

    rpc_address: str
    metrics_url: str
    log_path: Path

    def log_tail(self, max_bytes: int = 4000) -> str:
        """The end of the master's log, for error messages."""
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-max_bytes:].decode(errors="replace")


def find_master_binary() -> str:
    """Path of the ``mooncake_master`` binary shipped in the Mooncake wheel (or on PATH)."""
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "mooncake_master"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    for candidate_dir in (Path(sys.prefix) / "bin",):
        candidate = candidate_dir / "mooncake_master"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("mooncake_master")
    if found:
        return found
    raise PoolError(
        "mooncake_master not found: install the Mooncake wheel "
        "(pip install mooncake-transfer-engine-non-cuda) or put mooncake_master on PATH"
    )


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on ``host`` right now (another process may still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _decode_proc_addr(hex_addr: str) -> tuple[str, int]:
    ip_hex, port_hex = hex_addr.split(":")
    raw = bytes.fromhex(ip_hex)
    if len(raw) == 4:
        ip = str(ipaddress.IPv4Address(raw[::-1]))
    else:
        # /proc prints IPv6 as four host-order (little-endian) 32-bit words.
        words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
        ip = str(ipaddress.IPv6Address(words))
    return ip, int(port_hex, 16)


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """TCP addresses the process ``pid`` listens on, read from /proc (Linux)."""
    inodes: set[str] = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        for fd in fd_dir.iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:[") : -1])
    except OSError as exc:
        raise PoolError(f"cannot inspect sockets of pid {pid}: {exc}") from exc
    found: list[tuple[str, int]] = []
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            # fields: sl local rem state ... inode(9)
            if len(fields) > 9 and fields[3] == "0A" and fields[9] in inodes:
                found.append(_decode_proc_addr(fields[1]))
    return found


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback


def _holds_port(pid: int, host: str, port: int) -> bool:
    try:
        listening = listening_addresses(pid)
    except PoolError:
        # No /proc (not Linux): fall back to "something answers there".
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            return False
    want = ipaddress.ip_address(host)
    return any(
        p == port and (ipaddress.ip_address(a) == want or ipaddress.ip_address(a).is_unspecified)
        for a, p in listening
    )


def _health(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=0.5) as resp:
            body = json.loads(resp.read().decode())
    except (OSError, urllib.error.URLError, ValueError):
        return False
    return bool(body.get("service_ready"))


def stop_master(
    proc: subprocess.Popen[bytes], timeout_s: float = 5.0, *, graceful: bool = True
) -> int | None:
    """Stop a master: SIGTERM (unless not ``graceful``), SIGKILL after ``timeout_s``.

    Returns its exit status, or None if it outlived the SIGKILL wait too.
    """
    if proc.poll() is None:
        if graceful:
            proc.terminate()
        else:
            proc.kill()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                return None
    return proc.returncode


def _launch(
    binary: str,
    host: str,
    port: int,
    metrics_port: int,
    http_metadata_port: int | None,
    metric_reporting: bool,
    extra_args: Sequence[str],
    log_path: Path,
) -> MasterProcess:
    args = [
        binary,
        f"--rpc_address={host}",
        f"--rpc_port={port}",
        f"--metrics_host={host}",
        f"--metrics_port={metrics_port}",
        f"--enable_metric_reporting={'true' if metric_reporting else 'false'}",
        # Without this glog writes its files into /tmp on its own.
        "--logtostderr=true",
    ]
    if http_metadata_port is not None:
        args += [
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={host}",
            f"--http_metadata_server_port={http_metadata_port}",
        ]
    args += list(extra_args)
    with open(log_path, "ab") as log:
        proc = MasterProcess(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    proc.rpc_address = f"{host}:{port}"
    proc.metrics_url = f"http://{host}:{metrics_port}"
    proc.log_path = log_path
    return proc


def start_master(
    port: int = 0,
    *,
    host: str = LOOPBACK,
    metrics_port: int = 0,
    enable_http_metadata: bool = False,
    http_metadata_port: int = 0,
    allow_wildcard_bind: bool = False,
    ready_timeout_s: float = 10.0,
    metric_reporting: bool = False,
    extra_args: Sequence[str] = (),
    log_path: str | os.PathLike[str] | None = None,
) -> MasterProcess:
    """Start ``mooncake_master`` on ``host:port`` and wait until it serves (or raise PoolError).

    A port of 0 picks a free one (and retries on a lost race). Every server the master starts is
    given ``host`` explicitly; unless ``allow_wildcard_bind``, a master found listening on a
    non-loopback address (with a loopback ``host``) is stopped and PoolError raised.
    """
    binary = find_master_binary()
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="mooncake_master-", suffix=".log")
        os.close(fd)
        path = Path(name)
    else:
        path = Path(log_path)
    loopback_host = _is_loopback(host)
    last_error = ""
    # Retry only when the RPC port is ours to pick: a taken explicit port stays taken.
    attempts = _START_ATTEMPTS if port == 0 else 1
    for _ in range(attempts):
        # Not port 0 passed on: mooncake_master turns --rpc_port=0 into its default 50051 (and
        # reports no port it bound), so its ports are picked here and a lost race retried.
        rpc = port or free_port(host)
        metrics = metrics_port or free_port(host)
        http = None
        if enable_http_metadata:
            http = http_metadata_port or free_port(host)
        proc = _launch(binary, host, rpc, metrics, http, metric_reporting, extra_args, path)
        deadline = time.monotonic() + ready_timeout_s
        ready = False
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            # /health can say ready before the RPC port is bound (or found taken): also
            # require the master itself to hold its RPC port.
            if _health(f"{proc.metrics_url}/health") and _holds_port(proc.pid, host, rpc):
                ready = True
                break
            time.sleep(0.02)
        if not ready:
            exited = proc.poll() is not None
            stop_master(proc)
            last_error = proc.log_tail()
            if exited and "already in use" in last_error:
                continue  # lost a port race; pick new ports
            why = "exited" if exited else f"was not ready within {ready_timeout_s:.1f}s"
            raise PoolError(f"mooncake_master on {host}:{rpc} {why}; log {path}:\n{last_error}")
        if loopback_host and not allow_wildcard_bind:
            exposed = [(a, p) for a, p in listening_addresses(proc.pid) if not _is_loopback(a)]
            if exposed:
                stop_master(proc)
                raise PoolError(
                    f"mooncake_master listens beyond loopback on {exposed} although every server "
                    f"was given {host}; this build ignores the host for the HTTP metadata server. "
                    "Leave enable_http_metadata off (clients use P2PHANDSHAKE) or pass "
                    "allow_wildcard_bind=True knowingly"
                )
        return proc
    raise PoolError(
        f"mooncake_master could not bind free ports after {attempts} tries:\n{last_error}"
    )
