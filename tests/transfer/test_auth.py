"""Frame authentication of the control plane over real ZMQ sockets: what a sender without the
key gets (nothing), what a tampered, stale or foreign frame gets (a counted rejection), and that
an authenticated client is served all along."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import zmq
import zmq.asyncio

from app.errors import AuthError, ConfigError, ProtocolError
from app.transfer.control.client import PeerClient
from app.transfer.control.framing import ONE_WAY
from app.transfer.control.server import ControlServer
from app.transfer.wire.auth import (
    AUTH_VERSION,
    MAX_SKEW_S,
    OVERHEAD,
    UNAUTHENTICATED_REASON,
    FrameAuth,
)
from app.transfer.wire.codec import decode, encode
from app.transfer.wire.protocol import (
    Abort,
    Ack,
    AgentMetadata,
    AnyMsg,
    Done,
    Error,
    Hello,
    Msg,
    Role,
    Status,
)

pytestmark = pytest.mark.timeout(120)

KEY = FrameAuth(b"k" * 32)
OTHER = FrameAuth(b"o" * 32)
# What decode would hand a prefill that says Hello: none of it may reach a sender without the key.
EPOCH = "epoch-7f3a9c"
SESSION = "10.9.8.7:17100"
METADATA = AgentMetadata(engine_id="decode-0", epoch=EPOCH, tp_size=1, te_session=SESSION, ranks=[])
HELLO = Hello(compat_hash="c", engine_id="prefill-0", role=Role.PREFILL)
DONE = Done(
    request="r1",
    sender_engine="prefill-0",
    sender_rank=0,
    target_rank=0,
    epoch=EPOCH,
    status=Status.DONE,
    groups=[0],
    bytes=4096,
)
N_FRAMES = 10_000


def corr(n: int) -> bytes:
    return n.to_bytes(8, "big")


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Decode:
    """A handler that answers like decode would, and records every message it was given."""

    def __init__(self) -> None:
        self.seen: list[AnyMsg] = []

    async def __call__(self, msg: AnyMsg, peer: bytes) -> Msg | None:
        self.seen.append(msg)
        if isinstance(msg, Hello):
            return METADATA
        if isinstance(msg, Done | Abort):
            return Ack(request=msg.request)
        return Error(reason=f"unexpected {type(msg).__name__}")


@asynccontextmanager
async def serving(
    ctx: zmq.asyncio.Context, *, max_frame_bytes: int | None = None, log_interval_s: float = 5.0
) -> AsyncIterator[tuple[ControlServer, Decode, str]]:
    app = Decode()
    server = ControlServer(
        ctx,
        "tcp://127.0.0.1:0",
        app,
        name="auth",
        auth=KEY,
        max_frame_bytes=max_frame_bytes,
        log_interval_s=log_interval_s,
    )
    endpoint = await server.start()
    try:
        yield server, app, endpoint
    finally:
        await server.stop()


@asynccontextmanager
async def raw_dealer(ctx: zmq.asyncio.Context, endpoint: str) -> AsyncIterator[zmq.asyncio.Socket]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        yield sock
    finally:
        sock.close(linger=0)


async def exchange(sock: zmq.asyncio.Socket, frames: list[bytes]) -> list[bytes]:
    await sock.send_multipart(frames)
    return await asyncio.wait_for(sock.recv_multipart(), 5)


def assert_unauthenticated_reply(payload: bytes) -> None:
    """The reply is plain (the sender cannot verify our seal), fixed, and holds no state."""
    reply = decode(payload)
    assert isinstance(reply, Error)
    assert reply.reason == UNAUTHENTICATED_REASON
    for secret in (EPOCH, SESSION, "decode-0", "10.9.8.7"):
        assert secret.encode() not in payload


# --- FrameAuth itself ----------------------------------------------------------------------


def test_seal_then_open_gives_the_payload_back() -> None:
    payload = encode(HELLO)
    sealed = KEY.seal(payload)
    assert len(sealed) == len(payload) + OVERHEAD == len(payload) + 41
    assert sealed[0] == AUTH_VERSION
    assert KEY.open(sealed) == payload
    assert KEY.open(KEY.seal(b"")) == b""


def test_open_rejects_every_change() -> None:
    sealed = KEY.seal(encode(DONE))
    for i in range(len(sealed)):  # flip each byte in turn: version, timestamp, tag, payload
        broken = bytearray(sealed)
        broken[i] ^= 0x01
        with pytest.raises(AuthError):
            KEY.open(bytes(broken))
    with pytest.raises(AuthError, match="bad tag"):
        OTHER.open(sealed)
    with pytest.raises(AuthError, match="at least 41 bytes"):
        KEY.open(sealed[:40])


def test_skew_window_both_ways() -> None:
    t = now_ms()
    window_ms = int(MAX_SKEW_S * 1000)
    for at in (t - window_ms, t + window_ms, t):
        KEY.open(KEY.seal(b"x", at_ms=at), now_ms=t)
    with pytest.raises(AuthError, match="old"):
        KEY.open(KEY.seal(b"x", at_ms=t - window_ms - 1), now_ms=t)
    with pytest.raises(AuthError, match="in the future"):
        KEY.open(KEY.seal(b"x", at_ms=t + window_ms + 1), now_ms=t)


def test_key_is_at_least_32_bytes_and_never_shown() -> None:
    with pytest.raises(ConfigError, match="at least 32 bytes, got 31"):
        FrameAuth(b"k" * 31)
    assert "kkkk" not in repr(KEY)
    assert issubclass(AuthError, ProtocolError)


def sealed_with_version(version: int, payload: bytes, key: bytes = KEY.key) -> bytes:
    """A frame whose tag is right for its (wrong) version byte: only the version check stops it."""
    import hashlib
    import hmac

    header = bytes([version]) + now_ms().to_bytes(8, "big")
    return header + hmac.digest(key, header + payload, hashlib.sha256) + payload


def test_wrong_version_is_rejected_even_with_a_valid_tag() -> None:
    with pytest.raises(AuthError, match="expected auth version 1, got 0x02"):
        KEY.open(sealed_with_version(2, encode(HELLO)))
    with pytest.raises(AuthError, match="unsealed frame"):
        KEY.open(encode(HELLO) + b"\x00" * OVERHEAD)


# --- the server ----------------------------------------------------------------------------


async def test_hello_without_the_key_learns_nothing(ctx: zmq.asyncio.Context) -> None:
    async with serving(ctx) as (server, app, endpoint), raw_dealer(ctx, endpoint) as sock:
        _, payload = await exchange(sock, [corr(1), encode(HELLO)])
        assert_unauthenticated_reply(payload)
        assert app.seen == [], "the handler must never see an unauthenticated frame"
        assert server.unauthenticated_frames == 1
        assert server.rejected == 1


async def test_client_with_another_key_fails_and_is_told_why(ctx: zmq.asyncio.Context) -> None:
    async with serving(ctx) as (server, app, endpoint):
        stranger = PeerClient(ctx, endpoint, auth=OTHER)
        keyless = PeerClient(ctx, endpoint)
        try:
            with pytest.raises(AuthError) as info:
                await stranger.request(HELLO, 5.0)
            text = str(info.value)
            assert f"reply from {endpoint} is not authenticated" in text
            assert "different control-plane key" in text
            assert "(unverified)" in text and "not sealed with this sidecar" in text
            assert EPOCH not in text and SESSION not in text
            assert stranger.unauthenticated == 1
            # A sidecar without auth reads the server's reason as a plain Error.
            reply = await keyless.request(DONE, 5.0)
            assert isinstance(reply, Error) and reply.reason == UNAUTHENTICATED_REASON
        finally:
            await stranger.close()
            await keyless.close()
        assert app.seen == []
        assert server.unauthenticated_frames == 2


async def test_client_with_the_key_is_served(ctx: zmq.asyncio.Context) -> None:
    async with serving(ctx) as (server, app, endpoint):
        client = PeerClient(ctx, endpoint, auth=KEY)
        try:
            assert await client.request(HELLO, 5.0) == METADATA
            assert await client.request(DONE, 5.0) == Ack(request="r1")
            await client.notify(Abort(request="r2", reason="gone"))
            async with asyncio.timeout(5):
                while len(app.seen) < 3:
                    await asyncio.sleep(0.01)
        finally:
            await client.close()
        assert app.seen == [HELLO, DONE, Abort(request="r2", reason="gone")]
        assert server.unauthenticated_frames == 0 and server.rejected == 0


async def test_replies_are_sealed(ctx: zmq.asyncio.Context) -> None:
    async with serving(ctx) as (_, _, endpoint), raw_dealer(ctx, endpoint) as sock:
        _, payload = await exchange(sock, [corr(1), KEY.seal(encode(HELLO))])
        assert decode(KEY.open(payload)) == METADATA
        with pytest.raises(AuthError):
            OTHER.open(payload)


def forged_frames() -> dict[str, tuple[bytes, str]]:
    """Name -> (frame, what the server's log must say about it)."""
    good = KEY.seal(encode(DONE))
    tampered_payload = good[:-1] + bytes([good[-1] ^ 0x01])
    tag_at = 9
    tampered_tag = good[:tag_at] + bytes([good[tag_at] ^ 0x01]) + good[tag_at + 1 :]
    stale = KEY.seal(encode(DONE), at_ms=now_ms() - int(MAX_SKEW_S * 1000) - 5_000)
    future = KEY.seal(encode(DONE), at_ms=now_ms() + int(MAX_SKEW_S * 1000) + 5_000)
    return {
        "tampered-payload": (tampered_payload, "bad tag"),
        "tampered-tag": (tampered_tag, "bad tag"),
        "replayed-stale": (stale, "old"),
        "future": (future, "in the future"),
        "wrong-version": (sealed_with_version(2, encode(DONE)), "auth version"),
        "other-key": (OTHER.seal(encode(DONE)), "bad tag"),
        "unsealed": (encode(DONE), "auth version"),
        "short": (b"\x01" * 10, "at least 41 bytes"),
    }


@pytest.mark.parametrize("name", sorted(forged_frames()))
async def test_forged_frame_is_rejected_counted_and_logged(
    ctx: zmq.asyncio.Context, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    frame, logged = forged_frames()[name]
    with caplog.at_level(logging.WARNING, logger="app.transfer.control"):
        async with serving(ctx, log_interval_s=0.0) as (server, app, endpoint):
            async with raw_dealer(ctx, endpoint) as sock:
                _, payload = await exchange(sock, [corr(7), frame])
                assert_unauthenticated_reply(payload)
                # One-way: not answered, still counted and kept from the handler.
                await sock.send_multipart([ONE_WAY, frame])
                async with asyncio.timeout(5):
                    while server.frames < 2:
                        await asyncio.sleep(0.01)
                assert await sock.poll(200) == 0, "a one-way frame was answered"
            client = PeerClient(ctx, endpoint, auth=KEY)
            try:
                assert await client.request(DONE, 5.0) == Ack(request="r1")
            finally:
                await client.close()
            assert app.seen == [DONE], "only the authenticated Done reached the handler"
            assert server.unauthenticated_frames == 2
            assert server.rejected == 2
            assert server.counters()["unauthenticated_frames"] == 2
    lines = [r.getMessage() for r in caplog.records if "rejected a frame" in r.getMessage()]
    assert lines and all(logged in line for line in lines), lines


async def test_replay_inside_the_window_is_accepted(ctx: zmq.asyncio.Context) -> None:
    """The documented limit (README, security model): a captured frame replays for 60 s. The
    sidecar's handlers are idempotent for it (a repeated Done is acknowledged, counted once)."""
    async with serving(ctx) as (server, app, endpoint), raw_dealer(ctx, endpoint) as sock:
        captured = KEY.seal(encode(DONE), at_ms=now_ms() - int(MAX_SKEW_S * 1000) + 10_000)
        for n in (1, 2):
            _, payload = await exchange(sock, [corr(n), captured])
            assert decode(KEY.open(payload)) == Ack(request="r1")
        assert app.seen == [DONE, DONE]
        assert server.unauthenticated_frames == 0


async def test_frame_cap_applies_to_the_sealed_frame(ctx: zmq.asyncio.Context) -> None:
    async with (
        serving(ctx, max_frame_bytes=256) as (server, app, endpoint),
        raw_dealer(ctx, endpoint) as sock,
    ):
        payload = b"\x00" * (256 - OVERHEAD + 1)  # fits the cap unsealed, not sealed
        _, reply = await exchange(sock, [corr(1), KEY.seal(payload)])
        error = decode(reply)  # not sealed: the frame was never authenticated
        assert isinstance(error, Error) and "frame too large" in error.reason
        assert server.rejected == 1 and server.unauthenticated_frames == 0
        assert app.seen == []


async def test_ten_thousand_unauthenticated_frames(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    rng = random.Random(7)
    t = now_ms()
    good = KEY.seal(encode(DONE))
    makers = [
        lambda: encode(HELLO),  # no auth at all
        lambda: OTHER.seal(encode(HELLO)),  # another key
        lambda: KEY.seal(encode(DONE), at_ms=t - 3_600_000),  # an old capture replayed
        lambda: good[:20] + bytes([good[20] ^ 0xFF]) + good[21:],  # a flipped tag byte
        lambda: rng.randbytes(rng.randrange(0, 200)),  # noise
        lambda: sealed_with_version(rng.randrange(2, 256), encode(HELLO)),
    ]
    sends = []
    for n in range(1, N_FRAMES + 1):
        one_way = rng.random() < 0.1
        sends.append([ONE_WAY if one_way else corr(n), rng.choice(makers)()])
    answered = sum(1 for c, _ in sends if c != ONE_WAY)

    with caplog.at_level(logging.WARNING, logger="app.transfer.control"):
        async with serving(ctx) as (server, app, endpoint), raw_dealer(ctx, endpoint) as sock:
            t0 = time.perf_counter()
            got: dict[bytes, bytes] = {}

            async def receive() -> None:
                while len(got) < answered:
                    c, payload = await sock.recv_multipart()
                    assert c not in got, "two replies to one frame"
                    got[c] = payload

            reader = asyncio.create_task(receive())
            for frames in sends:
                await sock.send_multipart(frames)
            await asyncio.wait_for(reader, 60)
            elapsed = time.perf_counter() - t0
            assert server.frames == N_FRAMES
            assert server.unauthenticated_frames == N_FRAMES
            assert server.rejected == N_FRAMES
            assert server.replies == answered
            for payload in got.values():
                assert_unauthenticated_reply(payload)
            assert app.seen == []

            client = PeerClient(ctx, endpoint, auth=KEY)
            try:
                assert await client.request(HELLO, 5.0) == METADATA
            finally:
                await client.close()
    records = [r for r in caplog.records if r.name == "app.transfer.control"]
    assert 1 <= len(records) <= 2 * (elapsed / 5.0 + 1), [r.getMessage() for r in records]
    print(f"\n{N_FRAMES} unauthenticated frames answered in {elapsed:.2f} s")


@pytest.mark.parametrize(
    ("endpoint", "auth", "warned"),
    [
        ("tcp://0.0.0.0:0", None, True),
        ("tcp://0.0.0.0:0", KEY, False),
        ("tcp://127.0.0.1:0", None, False),
    ],
)
async def test_reachable_server_without_auth_warns(
    ctx: zmq.asyncio.Context,
    caplog: pytest.LogCaptureFixture,
    endpoint: str,
    auth: FrameAuth | None,
    warned: bool,
) -> None:
    server = ControlServer(ctx, endpoint, Decode(), name="exposed", auth=auth)
    with caplog.at_level(logging.WARNING, logger="app.transfer.control"):
        await server.start()
    await server.stop()
    said = any("without frame authentication" in r.getMessage() for r in caplog.records)
    assert said == warned


# --- the client ----------------------------------------------------------------------------


async def test_reply_that_fails_verification_fails_only_its_request(
    ctx: zmq.asyncio.Context,
) -> None:
    """A fake peer that seals most replies and forges one: only the forged one's request fails."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:0")
    endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)

    async def peer() -> None:
        while True:
            identity, c, payload = await router.recv_multipart()
            msg = decode(KEY.open(payload))
            assert isinstance(msg, Hello)
            if msg.engine_id == "slow":
                await asyncio.sleep(0.3)
            reply = encode(Ack(request=msg.engine_id))
            if msg.engine_id == "forged":
                # Sealed with another key, as a man in the middle would.
                await router.send_multipart([identity, c, OTHER.seal(reply)])
            elif msg.engine_id == "plain":
                await router.send_multipart([identity, c, reply])
            else:
                await router.send_multipart([identity, c, KEY.seal(reply)])

    task = asyncio.create_task(peer())
    client = PeerClient(ctx, endpoint, auth=KEY)
    try:
        slow = asyncio.create_task(
            client.request(Hello(compat_hash="c", engine_id="slow", role=Role.PREFILL), 5.0)
        )
        await asyncio.sleep(0.05)
        for name in ("forged", "plain"):
            with pytest.raises(AuthError, match=f"reply from {endpoint} is not authenticated"):
                await client.request(Hello(compat_hash="c", engine_id=name, role=Role.PREFILL), 5)
        assert await slow == Ack(request="slow")
        after = Hello(compat_hash="c", engine_id="after", role=Role.PREFILL)
        assert await client.request(after, 5.0) == Ack(request="after")
        assert client.unauthenticated == 2 and client.malformed == 2
    finally:
        await client.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        router.close(linger=0)


def test_seal_and_open_cost() -> None:
    """Microbenchmark for the report: a Done-sized frame, sealed and opened."""
    payload = encode(DONE)
    n = 20_000
    t0 = time.perf_counter()
    for _ in range(n):
        sealed = KEY.seal(payload)
    t1 = time.perf_counter()
    for _ in range(n):
        KEY.open(sealed)
    t2 = time.perf_counter()
    seal_us, open_us = (t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6
    print(f"\nseal {seal_us:.2f} us, open {open_us:.2f} us per {len(payload)}-byte frame")
    # Generous: a frame costs microseconds; a millisecond would mean something went wrong.
    assert seal_us < 1000 and open_us < 1000
