"""Frames over the cap are refused before decoding: counted, answered with Error, cheap."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from app.errors import DeadlineExceeded
from app.transfer.control.client import PeerClient
from app.transfer.control.framing import (
    DEFAULT_ENGINE_FRAME_BYTES,
    DEFAULT_MAX_FRAME_BYTES,
    ONE_WAY,
)
from app.transfer.control.server import ControlServer
from app.transfer.wire.codec import decode, encode
from app.transfer.wire.protocol import Ack, AnyMsg, Error, Hello, Msg, PoolLookup, Role

pytestmark = pytest.mark.timeout(60)

CORR = (9).to_bytes(8, "big")


async def ack_all(msg: AnyMsg, peer: bytes) -> Msg | None:
    return Ack(request=type(msg).__name__)


def hello(engine_id: str = "e") -> Hello:
    return Hello(compat_hash="c", engine_id=engine_id, role=Role.DECODE)


def big_lookup(nbytes: int) -> bytes:
    """A well-formed message of about ``nbytes``: only its size is wrong."""
    return encode(PoolLookup(rank=0, request="r", token_ids=[1] * nbytes))


@pytest.fixture
async def raw(ctx: zmq.asyncio.Context) -> AsyncIterator[zmq.asyncio.Socket]:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    yield s
    s.close(linger=0)


async def test_over_the_cap_is_an_error_reply(
    ctx: zmq.asyncio.Context, raw: zmq.asyncio.Socket
) -> None:
    server = ControlServer(ctx, "tcp://127.0.0.1:0", ack_all, max_frame_bytes=1024)
    raw.connect(await server.start())
    try:
        frame = big_lookup(1024)
        await raw.send_multipart([CORR, frame])
        corr, payload = await asyncio.wait_for(raw.recv_multipart(), 5)
        err = decode(payload)
        assert corr == CORR and isinstance(err, Error)
        assert f"frame too large: expected at most 1024 bytes, got {len(frame)} bytes" in err.reason
        assert server.rejected == 1
        # One-way: counted, not answered.
        await raw.send_multipart([ONE_WAY, big_lookup(2000)])
        deadline = time.monotonic() + 5
        while server.rejected < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert server.rejected == 2
        # At the cap exactly is fine, and the same connection is still served.
        fields: dict[str, object] = {"type": "hello", "compat_hash": "c", "role": 1}
        base = len(msgspec.msgpack.encode({**fields, "engine_id": ""}))
        # A 256+ character string has a 3-byte header where the empty one had 1.
        at_cap = msgspec.msgpack.encode({**fields, "engine_id": "x" * (1024 - base - 2)})
        assert len(at_cap) == 1024
        await raw.send_multipart([CORR, at_cap])
        assert await asyncio.wait_for(raw.recv_multipart(), 5) == [CORR, encode(Ack("Hello"))]
    finally:
        await server.stop()


async def test_default_cap_on_the_peer_port_answers_fast(
    ctx: zmq.asyncio.Context, raw: zmq.asyncio.Socket
) -> None:
    server = ControlServer(ctx, "tcp://127.0.0.1:0", ack_all)
    assert server.max_frame_bytes == DEFAULT_MAX_FRAME_BYTES == 1 << 20
    raw.connect(await server.start())
    try:
        frame = big_lookup(2 << 20)
        t0 = time.monotonic()
        await raw.send_multipart([CORR, frame])
        corr, payload = await asyncio.wait_for(raw.recv_multipart(), 5)
        assert corr == CORR
        # Refused on its size, not after decoding two million token ids.
        assert time.monotonic() - t0 < 1.0
        err = decode(payload)
        assert isinstance(err, Error) and "frame too large" in err.reason, err
        assert server.rejected == 1
    finally:
        await server.stop()


async def test_far_over_the_cap_never_reaches_the_process(ctx: zmq.asyncio.Context) -> None:
    server = ControlServer(ctx, "tcp://127.0.0.1:0", ack_all, max_frame_bytes=4096)
    endpoint = await server.start()
    try:
        sender = PeerClient(ctx, endpoint)
        try:
            # ZMQ drops the connection that sent it: the request ends at its deadline, unseen.
            with pytest.raises(DeadlineExceeded, match="no reply"):
                await sender.request(PoolLookup(rank=0, request="r", token_ids=[1] * 64_000), 1.0)
            # The sender's socket reconnects by itself and is served again.
            assert await sender.request(hello("again"), 5.0) == Ack(request="Hello")
        finally:
            await sender.close()
        assert (server.frames, server.rejected) == (1, 0)  # only the Hello after it
        # Everyone else is still served.
        client = PeerClient(ctx, endpoint)
        try:
            assert await client.request(hello(), 5.0) == Ack(request="Hello")
        finally:
            await client.close()
    finally:
        await server.stop()


async def test_engine_socket_gets_the_engine_cap(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    server = ControlServer(ctx, f"ipc://{tmp_path}/e.sock", ack_all)
    assert server.max_frame_bytes == DEFAULT_ENGINE_FRAME_BYTES
    client = PeerClient(ctx, await server.start(), max_frame_bytes=DEFAULT_ENGINE_FRAME_BYTES)
    try:
        # A long prompt's token ids (2M tokens, ~10 MB) pass on the engines' socket.
        msg = PoolLookup(rank=0, request="r", token_ids=[100_000] * 2_000_000)
        assert await client.request(msg, 20.0) == Ack(request="PoolLookup")
        assert server.rejected == 0
    finally:
        await client.close()
        await server.stop()
