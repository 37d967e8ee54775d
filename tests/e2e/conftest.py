"""Fixtures for end-to-end tests: real sidecars, engines and Mooncake, as separate processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from app.sim.cluster import Cluster, ClusterSpec
from app.transfer.wire.auth import FrameAuth, user_key
from app.transfer.wire.codec import decode, encode
from app.transfer.wire.protocol import AnyMsg, Msg


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[object]:
    """Start clusters on demand; all are stopped at the end of the test."""
    started: list[Cluster] = []

    def make(**kw: object) -> Cluster:
        spec = ClusterSpec(log_dir=str(tmp_path), **kw)  # type: ignore[arg-type]
        cluster = Cluster(spec).__enter__()
        started.append(cluster)
        return cluster

    yield make
    for c in started:
        c.close()


def request_entry(admin_url: str, rid: str) -> dict[str, Any]:
    """Request ``rid``'s one record on a sidecar's admin API (``/v1/requests/{rid}``)."""
    (entry,) = httpx.get(f"{admin_url}/v1/requests/{rid}", timeout=10).json()["entries"]
    return entry  # type: ignore[no-any-return]


def ask_control(
    port: int,
    msg: Msg,
    *,
    auth: FrameAuth | None = None,
    timeout_s: float = 5.0,
    sealed_reply: bool = True,
) -> AnyMsg:
    """One request to a sidecar's control port over a fresh DEALER, sealed with this user's
    generated key (the loopback default) unless ``auth`` is given. Refusals of frames that
    never reached authentication (too large) come back unsealed."""
    auth = auth or FrameAuth(user_key())
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send_multipart([b"\x00" * 7 + b"\x01", auth.seal(encode(msg))])
        assert sock.poll(int(timeout_s * 1000)), f"no reply to {type(msg).__name__}"
        payload = sock.recv_multipart()[1]
        return decode(auth.open(payload) if sealed_reply else payload)
    finally:
        ctx.destroy(0)
