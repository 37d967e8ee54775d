"""10,000 hostile frames at a real ControlServer: each one counted and answered, none escapes."""

from __future__ import annotations

import asyncio
import logging
import random
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from app.errors import ProtocolError
from app.transfer.control.client import PeerClient
from app.transfer.control.framing import ONE_WAY
from app.transfer.control.server import ControlServer
from app.transfer.wire.codec import decode, encode
from app.transfer.wire.protocol import (
    Abort,
    Ack,
    AddSend,
    AnyMsg,
    Done,
    Error,
    ExpectRecv,
    GetFinished,
    Hello,
    LayerReady,
    Msg,
    PoolLookup,
    RemoteTarget,
    Role,
    Status,
)

pytestmark = pytest.mark.timeout(120)

N_FRAMES = 10_000

VALID: list[Msg] = [
    Hello(compat_hash="c", engine_id="e", role=Role.DECODE, rank=1, epoch="ep"),
    Done(
        request="r",
        sender_engine="p",
        sender_rank=0,
        target_rank=1,
        epoch="ep",
        status=Status.DONE,
        groups=[0, 1],
        bytes=4096,
    ),
    Ack(request="r"),
    Abort(request="r", reason="why"),
    ExpectRecv(rank=0, request="r", prompt_len=64, block_ids=[[1, 2]], prefill_tp=2, timeout_s=5),
    AddSend(
        rank=0,
        request="r",
        prompt_len=64,
        block_ids=[[1, 2]],
        remote=RemoteTarget("r", "127.0.0.1", 5600, "d", "ep", 1, [[3, 4]]),
    ),
    LayerReady(rank=0, step=3, layer=-1),
    GetFinished(rank=0),
    PoolLookup(rank=0, request="r", token_ids=[1, 2, 3]),
]
ENCODED = [encode(m) for m in VALID]
WEIRD_VALUES: list[object] = [
    -1,
    0,
    2**63,
    -(2**63),
    float("nan"),
    float("inf"),
    1e300,
    "",
    "x" * 300,
    None,
    True,
    [],
    [[-1]],
    {},
    {"a": 1},
    b"\x00\xff",
]


def _mutate(rng: random.Random, frame: bytes) -> bytes:
    b = bytearray(frame)
    match rng.randrange(5):
        case 0 if b:  # flip a bit
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        case 1 if b:  # truncate
            del b[rng.randrange(len(b)) :]
        case 2:  # insert a byte
            b.insert(rng.randrange(len(b) + 1), rng.randrange(256))
        case 3 if b:  # overwrite a byte
            b[rng.randrange(len(b))] = rng.randrange(256)
        case _:  # append garbage
            b += rng.randbytes(rng.randrange(1, 16))
    return bytes(b)


def _bomb(rng: random.Random) -> bytes:
    depth = rng.randrange(500, 5000)
    opener = rng.choice([b"\x91", b"\x81\xa1k", b"\xdc\x00\x01"])
    return opener * depth + rng.choice([b"\xc0", b"", b"\xa1\xff"])


def _bad_field(rng: random.Random) -> bytes:
    fields = msgspec.msgpack.decode(rng.choice(ENCODED))
    key = rng.choice(sorted(fields))
    fields[key] = rng.choice(WEIRD_VALUES)
    return msgspec.msgpack.encode(fields)


def _bad_utf8(rng: random.Random) -> bytes:
    bad = rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"])
    where = rng.randrange(3)
    if where == 0:
        return bytes([0xA0 | len(bad)]) + bad
    if where == 1:  # as a key
        return b"\x81" + bytes([0xA0 | len(bad)]) + bad + b"\x01"
    return b"\x82\xa4type\xa5hello\xabcompat_hash" + bytes([0xA0 | len(bad)]) + bad


def fuzz_frames(n: int, seed: int = 11) -> list[bytes]:
    """``n`` payloads: random bytes, mutated valid messages, nesting bombs, bad UTF-8, fields
    with values of the wrong type or out of bounds."""
    rng = random.Random(seed)
    makers = [
        lambda: rng.randbytes(rng.randrange(0, 48)),
        lambda: _mutate(rng, rng.choice(ENCODED)),
        lambda: _mutate(rng, _mutate(rng, rng.choice(ENCODED))),
        lambda: _bomb(rng),
        lambda: _bad_field(rng),
        lambda: _bad_utf8(rng),
    ]
    return [rng.choice(makers)() for _ in range(n)]


def decodes(frame: bytes) -> bool:
    try:
        decode(frame)
    except ProtocolError:
        return False
    return True


async def ack_all(msg: AnyMsg, peer: bytes) -> Msg | None:
    return Ack(request=type(msg).__name__)


async def test_fuzzed_frames_are_all_counted_and_answered(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    frames = fuzz_frames(N_FRAMES)
    # Every frame must be judged by decode alone: whatever it raises, it is a ProtocolError.
    bad = [f for f in frames if not decodes(f)]
    assert len(bad) > 0.9 * N_FRAMES  # the fuzz mostly makes garbage, as meant

    # Some frames one-way (counted, never answered), some with bad framing.
    rng = random.Random(5)
    sends: list[list[bytes]] = []
    want: dict[bytes, bool] = {}  # corr -> whether the reply must be an Error
    n_unframed = 0
    for i, payload in enumerate(frames, start=1):
        corr = i.to_bytes(8, "big")
        kind = rng.randrange(20)
        if kind == 0:
            sends.append([ONE_WAY, payload])
        elif kind == 1:
            sends.append([corr, payload, b"extra"])
            want[corr] = True
        elif kind == 2:
            sends.append([corr[:3], payload])
            n_unframed += 1
        else:
            sends.append([corr, payload])
            want[corr] = not decodes(payload)
    expected_rejected = sum(1 for s in sends if len(s) != 2 or len(s[0]) != 8 or not decodes(s[1]))

    server = ControlServer(ctx, "tcp://127.0.0.1:0", ack_all, name="fuzz")
    endpoint = await server.start()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(endpoint)
    got: dict[bytes, AnyMsg] = {}
    unframed_replies = 0

    async def receive() -> None:
        nonlocal unframed_replies
        while len(got) < len(want) or unframed_replies < n_unframed:
            corr, payload = await raw.recv_multipart()
            assert corr not in got, "two replies to one frame"
            if corr == b"":
                unframed_replies += 1
                assert isinstance(decode(payload), Error)
            else:
                got[corr] = decode(payload)

    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="app.transfer.control"):
        try:
            reader = asyncio.create_task(receive())
            for s in sends:
                await raw.send_multipart(s)
            await asyncio.wait_for(reader, 60)
            # Nothing escaped the error path: every frame is a rejection or a handled message.
            assert server.frames == N_FRAMES
            assert server.rejected == expected_rejected
            assert server.replies == len(want) + n_unframed
            for corr, must_fail in want.items():
                assert isinstance(got[corr], Error) == must_fail, (corr, got[corr])
            assert server.handler_errors == 0

            # And the server still answers a well-behaved client.
            client = PeerClient(ctx, endpoint)
            try:
                hello = Hello(compat_hash="c", engine_id="after", role=Role.DECODE)
                assert await client.request(hello, 5.0) == Ack(request="Hello")
            finally:
                await client.close()
        finally:
            raw.close(linger=0)
            await server.stop()
    elapsed = time.monotonic() - t0

    records = [r for r in caplog.records if r.name == "app.transfer.control"]
    # Throttled: a line per kind of problem per interval, not ~9,500 lines.
    assert 1 <= len(records) <= 3 * (elapsed / 5.0 + 1), [r.getMessage() for r in records]
    assert not [r for r in records if r.exc_info], "a frame escaped to a traceback"
