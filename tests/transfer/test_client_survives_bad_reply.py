"""A bad reply fails at most the request it answers; the PeerClient serves every later one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from app.errors import ProtocolError
from app.transfer.control import client as control_client
from app.transfer.control.client import PeerClient
from app.transfer.wire.codec import decode, encode
from app.transfer.wire.protocol import Ack, AnyMsg, Hello, Role

pytestmark = pytest.mark.timeout(30)

# What the fake peer answers, by the engine_id of the Hello it got.
BAD_REPLIES: dict[str, list[bytes]] = {
    "utf8": [b"\xa1\xff"],  # once a UnicodeDecodeError that killed the client's reader
    "nested": [b"\x91" * 1001 + b"\xc0"],  # once a RecursionError
    "nested-maps": [b"\x81\xa1k" * 300 + b"\xc0"],
    "garbage": [b"\xc1\xc1"],
    "big": [encode(Ack(request="x" * 4000))],  # well-formed but over the client's cap
    "huge": [b"\x00" * 1_000_000],
}


def hello(engine_id: str) -> Hello:
    return Hello(compat_hash="c", engine_id=engine_id, role=Role.PREFILL)


async def fake_peer(sock: zmq.asyncio.Socket) -> None:
    """Answers each Hello as its engine_id says; ``ok`` and anything unknown get an Ack."""
    while True:
        identity, corr, payload = await sock.recv_multipart()
        msg = decode(payload)
        assert isinstance(msg, Hello)
        name = msg.engine_id
        if name == "stray":  # not a reply to anything, then the real one
            await sock.send_multipart([identity, b"\x00" * 7 + b"\x99", encode(Ack("stray"))])
            await sock.send_multipart([identity, b"one", b"two", b"three"])
            await sock.send_multipart([identity, b"only-one"])
        if name.startswith("slow"):
            await asyncio.sleep(0.3)
        for frame in BAD_REPLIES.get(name, [encode(Ack(request=name))]):
            await sock.send_multipart([identity, corr, frame])


@pytest.fixture
async def peer() -> AsyncIterator[tuple[zmq.asyncio.Context, str]]:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:0")
    task = asyncio.create_task(fake_peer(sock))
    try:
        yield ctx, sock.getsockopt_string(zmq.LAST_ENDPOINT)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        sock.close(linger=0)
        ctx.destroy(linger=0)


@pytest.mark.parametrize("bad", sorted(BAD_REPLIES))
async def test_bad_reply_fails_only_its_request(
    peer: tuple[zmq.asyncio.Context, str], bad: str
) -> None:
    ctx, endpoint = peer
    client = PeerClient(ctx, endpoint, max_frame_bytes=1024)
    try:
        # Another request is in flight while the bad reply comes: it must not be hurt.
        other = asyncio.create_task(client.request(hello("slow-ok"), 5.0))
        await asyncio.sleep(0.05)
        with pytest.raises(ProtocolError, match=f"reply from {endpoint}"):
            await client.request(hello(bad), 5.0)
        assert client.malformed == 1
        assert await other == Ack(request="slow-ok")
        # And every later request is served (this is what a dead reader would time out on).
        for i in range(3):
            assert await client.request(hello(f"after-{i}"), 2.0) == Ack(request=f"after-{i}")
        assert client.replies == 4
    finally:
        await client.close()


async def test_stray_replies_are_dropped_and_counted(
    peer: tuple[zmq.asyncio.Context, str],
) -> None:
    ctx, endpoint = peer
    client = PeerClient(ctx, endpoint)
    try:
        assert await client.request(hello("stray"), 2.0) == Ack(request="stray")
        assert client.dropped == 1  # a corr_id no request is waiting for
        assert client.malformed == 2  # three frames, one frame
        assert await client.request(hello("next"), 2.0) == Ack(request="next")
    finally:
        await client.close()


async def test_unexpected_decode_failure_fails_only_its_request(
    peer: tuple[zmq.asyncio.Context, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx, endpoint = peer
    real = control_client.decode

    def flaky(frame: bytes) -> AnyMsg:
        if b"boom" in frame:
            raise RuntimeError("a bug, not a ProtocolError")
        return real(frame)

    monkeypatch.setattr(control_client, "decode", flaky)
    client = PeerClient(ctx, endpoint)
    try:
        with pytest.raises(ProtocolError, match="a bug"):
            await client.request(hello("boom"), 2.0)
        assert await client.request(hello("after"), 2.0) == Ack(request="after")
    finally:
        await client.close()
