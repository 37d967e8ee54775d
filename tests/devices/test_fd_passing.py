"""Descriptors cross processes over the unix socket as cuMem chunks would (memfds here): all of
them, in order, also past one message's limit, and only to a client that knows the token."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.devices.fdpass import FdServer, receive_fds
from app.errors import ConfigError

COUNT = 300  # more than one SCM_RIGHTS message carries


@pytest.fixture
def server(tmp_path: Path) -> Iterator[FdServer]:
    fds = []
    for i in range(COUNT):
        fd = os.memfd_create(f"chunk-{i}")
        os.write(fd, f"chunk {i}".encode())
        fds.append(fd)
    srv = FdServer(str(tmp_path / "fds.sock"), fds, b"k" * 32)
    yield srv
    srv.close()


def test_another_process_receives_every_descriptor_in_order(server: FdServer) -> None:
    script = textwrap.dedent(
        f"""
        import os
        from app.devices.fdpass import receive_fds
        fds = receive_fds({server.path!r}, b"k" * 32, {COUNT})
        ok = all(os.pread(fd, 16, 0) == f"chunk {{i}}".encode() for i, fd in enumerate(fds))
        print("ok" if ok else "wrong")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).parents[2],
    )
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
    assert (os.stat(server.path).st_mode & 0o777) == 0o600


def test_a_wrong_token_gets_nothing(server: FdServer) -> None:
    with pytest.raises(ConfigError, match="expected 300 descriptors, got 0"):
        receive_fds(server.path, b"x" * 32, COUNT)


def test_a_missing_socket_says_what_to_share(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="must share the engine's /dev/shm"):
        receive_fds(str(tmp_path / "none.sock"), b"k" * 32, 1)
