"""Shared fixtures of the device tests: event rings, and one real P/D pair for the session."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from app.devices.events import EngineRing
from tests.devices.harness import PARAMS, SEND_TIMEOUT_S, Pair, start_pair


@pytest.fixture
def make_ring() -> Iterator[Callable[..., EngineRing]]:
    """Engine rings on this machine's /dev/shm, closed (and unlinked) after the test."""
    made: list[EngineRing] = []

    def make(layers: int = 2, **kw: object) -> EngineRing:
        ring = EngineRing.create(layers, prefix="kvs-test", **kw)  # type: ignore[arg-type]
        made.append(ring)
        return ring

    yield make
    for ring in made:
        ring.close()


@pytest.fixture(scope="session")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """A prefill sidecar with an event ring on its rank, a decode sidecar, both real."""
    logs = tmp_path_factory.mktemp("pd-logs")
    # ZMQ ipc paths must be short (108 bytes): sockets in /dev/shm, logs in pytest's tmp.
    sockets = Path(tempfile.mkdtemp(prefix="kvs-devtest-", dir="/dev/shm"))
    p = start_pair(sockets, logs, PARAMS, send_timeout_s=SEND_TIMEOUT_S)
    try:
        yield p
    finally:
        p.close()
        shutil.rmtree(sockets, ignore_errors=True)
