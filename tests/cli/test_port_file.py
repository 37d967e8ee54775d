"""Servers told port 0 bind whatever the OS gives them and report it in a port file.

Nothing here guesses a free port: two sidecars (and two proxies) start at once on port 0 and
each must report its own ports, which must then answer.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import httpx
import pytest
import zmq

from app.config import load_settings
from app.errors import ConfigError
from app.ports import read_port_file, wait_port_file, write_port_file
from app.transfer.wire.auth import FrameAuth, user_key
from app.transfer.wire.codec import decode, encode
from app.transfer.wire.protocol import Ping, Pong

START_TIMEOUT_S = 120.0  # two processes importing the sidecar on two busy cores


def _spawn(
    args: list[str], log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "app.cli.main", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )


def _alive(proc: subprocess.Popen[bytes], log: Path) -> None:
    if proc.poll() is not None:
        pytest.fail(f"exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _ping(port: int) -> Pong:
    """A Ping to a control port, sealed with this user's generated key (the loopback default)."""
    auth = FrameAuth(user_key())
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send_multipart([b"\x00" * 7 + b"\x01", auth.seal(encode(Ping("tester", "e")))])
        assert sock.poll(10_000), f"no answer on control port {port}"
        reply = decode(auth.open(sock.recv_multipart()[1]))
    finally:
        ctx.destroy(0)
    assert isinstance(reply, Pong), reply
    return reply


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    _stop(started)


def test_two_sidecars_on_port_zero_report_distinct_working_ports(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    names = ("a", "b")
    ipc = Path("/dev/shm") / f"kvs-ports-{os.getpid()}-{tmp_path.name}"
    ipc.mkdir()
    try:
        for name in names:
            args = ["serve", "--role", "decode", "--engine-id", name, "--control-host"]
            args += ["127.0.0.1", "--control-port", "0", "--admin-port", "0"]
            args += ["--engine-ipc", f"ipc://{ipc}/{name}.sock"]
            args += ["--port-file", str(tmp_path / f"{name}.json")]
            env = {"KVSIDECAR_ADVERTISE_HOST": "127.0.0.1", "MC_FORCE_TCP": "1"}
            procs.append(_spawn(args, tmp_path / f"{name}.log", env))
        ports = {}
        for name, proc in zip(names, procs, strict=True):
            ports[name] = wait_port_file(
                tmp_path / f"{name}.json",
                ("admin_port", "control_port"),
                START_TIMEOUT_S,
                check=partial(_alive, proc, tmp_path / f"{name}.log"),
            )
        every = [p for ps in ports.values() for p in ps.values()]
        assert len(set(every)) == 4, ports
        for name, got in ports.items():
            admin = f"http://127.0.0.1:{got['admin_port']}"
            assert httpx.get(f"{admin}/livez", timeout=10).status_code == 200
            status = httpx.get(f"{admin}/v1/status", timeout=10).json()
            assert status["engine_id"] == name
            # What peers are told is the port bound, not the 0 asked for.
            assert status["control_endpoint"] == f"tcp://127.0.0.1:{got['control_port']}"
            assert _ping(got["control_port"]).epoch == status["epoch"]
            assert f"admin_port={got['admin_port']}" in (tmp_path / f"{name}.log").read_text()
        _stop(procs)
        assert [p.returncode for p in procs] == [0, 0]
        # Nothing listens on those ports any more: a stale file must not say otherwise.
        assert not any((tmp_path / f"{n}.json").exists() for n in names)
    finally:
        for f in ipc.glob("*"):
            f.unlink()
        ipc.rmdir()


def test_two_proxies_on_port_zero_report_distinct_working_ports(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    for name in ("p1", "p2"):
        args = ["proxy", "--prefill", "http://127.0.0.1:9/", "--decode", "http://127.0.0.1:9/"]
        args += ["--port", "0", "--port-file", str(tmp_path / f"{name}.json")]
        # A stale file from an earlier run: the proxy replaces it with its own port.
        write_port_file(tmp_path / f"{name}.json", {"stale": 1})
        procs.append(_spawn(args, tmp_path / f"{name}.log"))
    ports = [
        wait_port_file(
            tmp_path / f"{name}.json",
            ("port",),
            START_TIMEOUT_S,
            check=partial(_alive, proc, tmp_path / f"{name}.log"),
        )["port"]
        for name, proc in zip(("p1", "p2"), procs, strict=True)
    ]
    assert ports[0] != ports[1]
    for port in ports:
        # No instance is healthy (nothing listens on port 9), but the proxy answers.
        r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
        assert r.status_code == 503 and r.json()
    logs = [(tmp_path / f"{n}.log").read_text() for n in ("p1", "p2")]
    assert all(
        f"proxy listening on http://127.0.0.1:{p}" in t for p, t in zip(ports, logs, strict=True)
    )
    _stop(procs)
    assert not any((tmp_path / f"{n}.json").exists() for n in ("p1", "p2"))


def test_port_zero_is_a_valid_setting_for_both_listeners() -> None:
    s = load_settings({"admin_port": 0, "control_port": 0, "port_file": "/tmp/x.json"})
    assert (s.admin_port, s.control_port, s.port_file) == (0, 0, Path("/tmp/x.json"))
    with pytest.raises(ConfigError, match="both 5601"):
        load_settings({"admin_port": 5601, "control_port": 5601})


def test_port_file_is_json_written_whole(tmp_path: Path) -> None:
    path = tmp_path / "ports.json"
    assert read_port_file(path) is None
    write_port_file(path, {"admin_port": 8300, "control_port": 5600})
    assert json.loads(path.read_text()) == {"admin_port": 8300, "control_port": 5600}
    assert [p.name for p in tmp_path.iterdir()] == ["ports.json"]  # no temporary left
    path.write_text('{"admin_port": "x"}')
    with pytest.raises(ConfigError, match="should map names to ports"):
        read_port_file(path)
