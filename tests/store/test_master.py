"""Starting mooncake_master on loopback: readiness, binds, failures that must be loud."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from pathlib import Path

import pytest

from app.errors import PoolError
from app.store.master import (
    _decode_proc_addr,
    find_master_binary,
    free_port,
    listening_addresses,
    start_master,
    stop_master,
)


def test_proc_net_addresses_decode() -> None:
    assert _decode_proc_addr("0100007F:1F90") == ("127.0.0.1", 8080)
    assert _decode_proc_addr("00000000:0050") == ("0.0.0.0", 80)
    assert _decode_proc_addr("00000000000000000000000001000000:1F90") == ("::1", 8080)


def test_master_serves_on_loopback_only(tmp_path: Path) -> None:
    t0 = time.monotonic()
    proc = start_master(0, log_path=tmp_path / "m.log")
    try:
        assert time.monotonic() - t0 < 10
        host, port = proc.rpc_address.rsplit(":", 1)
        assert host == "127.0.0.1"
        with urllib.request.urlopen(f"{proc.metrics_url}/health", timeout=2) as resp:
            assert json.loads(resp.read())["service_ready"] is True
        listening = listening_addresses(proc.pid)
        assert ("127.0.0.1", int(port)) in listening
        assert all(addr == "127.0.0.1" for addr, _ in listening), listening
    finally:
        assert stop_master(proc, timeout_s=5.0) is not None
    assert proc.poll() is not None


def test_http_metadata_server_binding_all_interfaces_is_refused(tmp_path: Path) -> None:
    # This build binds the HTTP metadata server to 0.0.0.0 whatever host it is given.
    http_port = free_port()
    with pytest.raises(PoolError, match="beyond loopback"):
        start_master(
            0, enable_http_metadata=True, http_metadata_port=http_port, log_path=tmp_path / "m.log"
        )
    # ...and the refused master is gone, not left listening.
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", http_port), timeout=1):
        pass


def test_taken_port_fails_fast_with_the_log(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(PoolError, match="exited"):
            start_master(port, log_path=tmp_path / "m.log", ready_timeout_s=10.0)
        assert time.monotonic() - t0 < 5


def test_binary_is_found() -> None:
    assert Path(find_master_binary()).name == "mooncake_master"
