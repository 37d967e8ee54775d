"""ControlServer / PeerClient / SyncClient over real ZMQ sockets (tcp loopback and ipc)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from app.engine_link.sync_client import SyncClient
from app.errors import DeadlineExceeded
from app.transfer.control.client import PeerClient
from app.transfer.control.framing import ONE_WAY, ClientClosed
from app.transfer.control.server import ControlServer
from app.transfer.wire.codec import decode, encode
from app.transfer.wire.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Ack,
    AnyMsg,
    Error,
    GetFinished,
    Hello,
    LayerReady,
    Msg,
    Rejected,
    Role,
)

pytestmark = pytest.mark.timeout(30)

TCP = "tcp://127.0.0.1:0"
COMPAT = "compat-1"


def hello(engine_id: str = "e0", compat: str = COMPAT) -> Hello:
    return Hello(compat_hash=compat, engine_id=engine_id, role=Role.DECODE)


class App:
    """A handler with a few behaviours keyed on the message, recording what it saw."""

    def __init__(self) -> None:
        self.layers: list[LayerReady] = []
        self.layer_event = asyncio.Event()
        self.peers: set[bytes] = set()
        self.cancelled = 0

    async def __call__(self, msg: AnyMsg, peer: bytes) -> Msg | None:
        self.peers.add(peer)
        match msg:
            case Hello(engine_id=engine_id, compat_hash=compat):
                if engine_id.startswith("slow"):
                    try:
                        await asyncio.sleep(float(engine_id.split(":")[1]))
                    except asyncio.CancelledError:
                        self.cancelled += 1
                        raise
                if compat != COMPAT:
                    return Rejected(reason=f"compat hash {compat} != {COMPAT}")
                return Ack(request=engine_id)
            case Abort(reason=reason):
                raise RuntimeError(reason)
            case LayerReady():
                self.layers.append(msg)
                self.layer_event.set()
                # Even a reply to a one-way message must not go out.
                return Ack(request="one-way")
            case GetFinished():
                return None
        return Error(reason=f"unexpected {type(msg).__name__}")


@asynccontextmanager
async def serving(
    ctx: zmq.asyncio.Context,
    endpoint: str = TCP,
    handler: Callable[[AnyMsg, bytes], Awaitable[Msg | None]] | None = None,
    **kw: int,
) -> AsyncIterator[tuple[ControlServer, App]]:
    app = App()
    server = ControlServer(ctx, endpoint, handler or app, name="test", **kw)
    await server.start()
    try:
        yield server, app
    finally:
        await server.stop()


@asynccontextmanager
async def client(ctx: zmq.asyncio.Context, endpoint: str) -> AsyncIterator[PeerClient]:
    c = PeerClient(ctx, endpoint)
    try:
        yield c
    finally:
        await c.close()


async def until(cond: Callable[[], bool], timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


async def raw_recv(sock: zmq.asyncio.Socket, timeout: float = 2.0) -> list[bytes]:
    return await asyncio.wait_for(sock.recv_multipart(), timeout)


async def nothing_arrives(sock: zmq.asyncio.Socket, wait: float = 0.2) -> bool:
    try:
        await asyncio.wait_for(sock.recv_multipart(), wait)
    except TimeoutError:
        return True
    return False


# ---- round trips ---------------------------------------------------------------------------


async def test_round_trip_tcp(ctx: zmq.asyncio.Context) -> None:
    async with serving(ctx) as (server, app), client(ctx, server.endpoint or "") as c:
        assert server.port is not None and server.port > 0
        assert server.endpoint == f"tcp://127.0.0.1:{server.port}"
        assert await c.request(hello("e1"), timeout=2.0) == Ack(request="e1")
        bad = await c.request(hello("e1", compat="other"), timeout=2.0)
        assert isinstance(bad, Rejected) and "other" in bad.reason
        assert len(app.peers) == 1
        assert server.counters() == {
            "frames": 2,
            "replies": 2,
            "rejected": 0,
            "unauthenticated_frames": 0,
            "handler_errors": 0,
        }
        assert c.counters()["replies"] == 2


async def test_round_trip_ipc(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    sock_path = tmp_path / "run" / "sidecar" / "engine.sock"  # parent dirs do not exist yet
    async with (
        serving(ctx, f"ipc://{sock_path}") as (server, _),
        client(ctx, f"ipc://{sock_path}") as c,
    ):
        assert sock_path.exists()
        assert server.port is None
        assert server.endpoint == f"ipc://{sock_path}"
        assert await c.request(hello("ipc"), timeout=2.0) == Ack(request="ipc")


async def test_concurrent_clients_get_their_own_replies(ctx: zmq.asyncio.Context) -> None:
    async with serving(ctx) as (server, app):
        clients = [PeerClient(ctx, server.endpoint or "") for _ in range(4)]
        try:
            ids = [[f"c{i}-r{j}" for j in range(25)] for i in range(len(clients))]
            replies = await asyncio.gather(
                *(
                    c.request(hello(rid), 5.0)
                    for c, rids in zip(clients, ids, strict=True)
                    for rid in rids
                )
            )
        finally:
            for c in clients:
                await c.close()
        assert replies == [Ack(request=rid) for rids in ids for rid in rids]
        assert len(app.peers) == 4
        assert server.replies == 100


async def test_slow_handler_does_not_delay_a_fast_one(ctx: zmq.asyncio.Context) -> None:
    async with serving(ctx) as (server, _), client(ctx, server.endpoint or "") as c:
        slow = asyncio.create_task(c.request(hello("slow:1.0"), 5.0))
        await asyncio.sleep(0.05)  # the slow one is in its handler first
        t0 = time.monotonic()
        assert await c.request(hello("fast"), 2.0) == Ack(request="fast")
        assert time.monotonic() - t0 < 0.5
        assert not slow.done()
        assert await asyncio.wait_for(slow, 3.0) == Ack(request="slow:1.0")


async def test_inline_types_are_answered_in_the_receive_loop(ctx: zmq.asyncio.Context) -> None:
    ran_in: dict[str, str] = {}

    async def handler(msg: AnyMsg, ident: bytes) -> Msg | None:
        task = asyncio.current_task()
        ran_in[type(msg).__name__] = task.get_name() if task else ""
        return Ack(request=type(msg).__name__)

    server = ControlServer(ctx, TCP, handler, name="t", max_inflight=1, inline=(GetFinished,))
    await server.start()
    try:
        async with client(ctx, server.endpoint or "") as c:
            assert await c.request(GetFinished(rank=0), 2.0) == Ack(request="GetFinished")
            assert await c.request(hello("e1"), 2.0) == Ack(request="Hello")
    finally:
        await server.stop()
    assert ran_in == {"GetFinished": "t-recv", "Hello": "t-Hello"}


async def test_max_inflight_bounds_concurrent_handlers(ctx: zmq.asyncio.Context) -> None:
    gate = asyncio.Event()
    running = peak = 0

    async def handler(msg: AnyMsg, peer: bytes) -> Msg | None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await gate.wait()
        running -= 1
        assert isinstance(msg, Hello)
        return Ack(request=msg.engine_id)

    async with (
        serving(ctx, handler=handler, max_inflight=2) as (server, _),
        client(ctx, server.endpoint or "") as c,
    ):
        reqs = [asyncio.create_task(c.request(hello(f"r{i}"), 5.0)) for i in range(6)]
        await until(lambda: server.frames >= 3)  # the third frame waits for a slot
        await asyncio.sleep(0.1)
        assert peak == 2
        gate.set()
        assert await asyncio.wait_for(asyncio.gather(*reqs), 5.0) == [
            Ack(request=f"r{i}") for i in range(6)
        ]
        assert peak == 2


# ---- bad input -----------------------------------------------------------------------------


async def test_malformed_frames_get_error_and_loop_keeps_serving(
    ctx: zmq.asyncio.Context,
) -> None:
    async with serving(ctx) as (server, _):
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(server.endpoint or "")
        try:
            corr = (7).to_bytes(8, "big")
            future = Hello(compat_hash="x", engine_id="e", role=Role.PREFILL, version=99)
            cases: list[tuple[list[bytes], bytes, str]] = [
                ([corr, b"\xc1garbage"], corr, "malformed frame"),
                (
                    [corr, msgspec.msgpack.encode({"type": "nope", "version": PROTOCOL_VERSION})],
                    corr,
                    "malformed",
                ),
                ([corr, encode(future)], corr, "version 99"),
                ([corr, encode(hello()), b"extra"], corr, "got 3 frame(s)"),
                ([encode(hello())], b"", "got 1 frame(s)"),
                ([b"abc", encode(hello())], b"", "corr_id(8 bytes)"),
            ]
            for i, (frames, want_corr, want_reason) in enumerate(cases, start=1):
                await raw.send_multipart(frames)
                got_corr, payload = await raw_recv(raw)
                err = decode(payload)
                assert got_corr == want_corr
                assert isinstance(err, Error) and want_reason in err.reason, err
                assert server.rejected == i
            # A malformed one-way frame is counted but never answered.
            await raw.send_multipart([ONE_WAY, b"\xc1garbage"])
            await until(lambda: server.rejected == len(cases) + 1)
            assert await nothing_arrives(raw)
            # The same socket and a fresh client are both still served.
            await raw.send_multipart([corr, encode(hello("raw"))])
            assert await raw_recv(raw) == [corr, encode(Ack(request="raw"))]
        finally:
            raw.close(linger=0)
        async with client(ctx, server.endpoint or "") as c:
            assert await c.request(hello("after"), 2.0) == Ack(request="after")
        assert server.handler_errors == 0


async def test_handler_exception_becomes_error_reply(ctx: zmq.asyncio.Context) -> None:
    async with serving(ctx) as (server, _), client(ctx, server.endpoint or "") as c:
        reply = await c.request(Abort(request="r1", reason="boom: disk on fire"), 2.0)
        assert reply == Error(reason="boom: disk on fire")
        assert server.handler_errors == 1
        assert await c.request(hello("next"), 2.0) == Ack(request="next")


async def test_handler_returning_none_to_a_request_fails_fast(ctx: zmq.asyncio.Context) -> None:
    async with serving(ctx) as (server, _), client(ctx, server.endpoint or "") as c:
        t0 = time.monotonic()
        reply = await c.request(GetFinished(rank=0), 5.0)
        assert isinstance(reply, Error) and "GetFinished" in reply.reason
        assert time.monotonic() - t0 < 1.0
        assert server.handler_errors == 1


# ---- deadlines -----------------------------------------------------------------------------


async def test_timeout_then_late_reply_is_dropped(ctx: zmq.asyncio.Context) -> None:
    async with serving(ctx) as (server, _), client(ctx, server.endpoint or "") as c:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded, match=r"no reply from tcp://.* to Hello within 0\.2s"):
            await c.request(hello("slow:0.5"), timeout=0.2)
        assert 0.2 <= time.monotonic() - t0 < 0.5
        await until(lambda: c.dropped == 1)  # the reply arrived after all, and was not delivered
        assert server.replies == 1
        assert await c.request(hello("next"), 2.0) == Ack(request="next")
        assert c.dropped == 1


@pytest.mark.parametrize("kind", ["tcp", "ipc"])
async def test_nothing_listening_times_out(
    ctx: zmq.asyncio.Context, tmp_path: Path, kind: str
) -> None:
    if kind == "tcp":
        probe = ctx.socket(zmq.ROUTER)
        port = probe.bind_to_random_port("tcp://127.0.0.1")
        probe.close(linger=0)
        endpoint = f"tcp://127.0.0.1:{port}"
    else:
        endpoint = f"ipc://{tmp_path}/nobody.sock"
    async with client(ctx, endpoint) as c:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded, match=r"within 0\.3s"):
            await c.request(hello(), timeout=0.3)
        assert time.monotonic() - t0 < 1.0


async def test_close_fails_waiting_requests(ctx: zmq.asyncio.Context) -> None:
    async with serving(ctx) as (server, app):
        c = PeerClient(ctx, server.endpoint or "")
        pending = asyncio.create_task(c.request(hello("slow:2"), 5.0))
        await until(lambda: server.frames == 1)
        await c.close()
        with pytest.raises(ClientClosed):
            await asyncio.wait_for(pending, 1.0)
        with pytest.raises(ClientClosed):
            await c.request(hello(), 1.0)
    assert app.cancelled == 1  # server.stop() cancelled the still-running handler


# ---- one-way -------------------------------------------------------------------------------


async def test_notify_is_delivered_and_never_answered(ctx: zmq.asyncio.Context) -> None:
    async with serving(ctx) as (server, app):
        async with client(ctx, server.endpoint or "") as c:
            for layer in range(20):
                await c.notify(LayerReady(rank=0, step=3, layer=layer))
            await until(lambda: len(app.layers) == 20)
            assert [m.layer for m in app.layers] == list(range(20))
            # A request after the notifies is answered; nothing else came back.
            assert await c.request(hello("after"), 2.0) == Ack(request="after")
            assert c.dropped == 0 and c.malformed == 0
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(server.endpoint or "")
        try:
            await raw.send_multipart([ONE_WAY, encode(LayerReady(rank=1, step=0, layer=0))])
            await until(lambda: len(app.layers) == 21)
            assert await nothing_arrives(raw)
        finally:
            raw.close(linger=0)
        assert server.replies == 1


# ---- engine side (blocking client) ---------------------------------------------------------


async def test_sync_client_against_async_server(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/engine.sock"
    async with serving(ctx, endpoint) as (server, app):
        sc = SyncClient(endpoint)
        try:
            assert await asyncio.to_thread(sc.request, hello("sync"), 2.0) == Ack(request="sync")
            await asyncio.to_thread(sc.notify, LayerReady(rank=0, step=1, layer=5))
            await asyncio.wait_for(app.layer_event.wait(), 2.0)
            assert app.layers == [LayerReady(rank=0, step=1, layer=5)]

            t0 = time.monotonic()
            with pytest.raises(DeadlineExceeded, match=r"to Hello within 0\.2s"):
                await asyncio.to_thread(sc.request, hello("slow:0.4"), 0.2)
            assert time.monotonic() - t0 < 0.5
            await until(lambda: server.replies == 2)  # the late reply is now in sc's queue
            # The next request skips the late reply and gets its own.
            assert await asyncio.to_thread(sc.request, hello("next"), 2.0) == Ack(request="next")
            assert sc.dropped == 1
            reply = await asyncio.to_thread(sc.request, Abort(request="r", reason="bad"), 2.0)
            assert reply == Error(reason="bad")
        finally:
            sc.close()
        with pytest.raises(ClientClosed):
            sc.request(hello(), 1.0)


async def test_sync_client_nothing_listening(tmp_path: Path) -> None:
    sc = SyncClient(f"ipc://{tmp_path}/nobody.sock")
    try:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await asyncio.to_thread(sc.request, hello(), 0.3)
        assert time.monotonic() - t0 < 1.0
    finally:
        sc.close()


def test_sync_notify_raises_when_the_queue_is_full(tmp_path: Path) -> None:
    ctx = zmq.Context()
    try:
        sc = SyncClient(f"ipc://{tmp_path}/nobody.sock", ctx=ctx, notify_timeout=0.2)
        try:
            # Nothing listens, so the queue fills at the default HWM (1000) and then stays full.
            sent = 0
            with pytest.raises(DeadlineExceeded, match="not reading"):
                for step in range(100_000):
                    sc.notify(LayerReady(rank=0, step=step, layer=0))
                    sent += 1
            assert 0 < sent < 100_000
            assert sc.notifies == sent
        finally:
            sc.close()
    finally:
        ctx.term()
