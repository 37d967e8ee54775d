"""10,000 malformed frames at a sidecar socket while a normal transfer runs through it.

Random bytes, truncated messages, msgpack headers announcing huge lengths, real message tags
with wrong field types, deep nesting, unknown versions, bad framing (and, at the control
port, a few frames over the size cap). None of them decodes as a valid message (checked here:
a valid ``GetFinished`` would legitimately take the engine's reports). At the control port,
which authenticates every frame, half of them are sealed with the deployment key (this user's
generated loopback key, as the sidecars use), so that they get past the HMAC check and reach
the decoder; the other half are refused as unauthenticated. The transfer still ends DONE
byte-exact, the sidecar answers ``/livez`` during and after the flood, and its rejected frame
counter grew.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from app.transfer.control.framing import ONE_WAY
from app.transfer.wire.auth import FrameAuth, user_key
from app.transfer.wire.codec import decode, encode
from app.transfer.wire.protocol import (
    PROTOCOL_VERSION,
    AddSend,
    BeginStep,
    Done,
    ExpectRecv,
    GetFinished,
    Hello,
    LayerReady,
    RemoteTarget,
    Role,
    Status,
    StepSlice,
)
from tests.chaos.harness import LENS, Chaos, Outcome, metric_sum

# Minutes of simulated-cluster faults: CI runs them apart (pytest -m slow_chaos).
pytestmark = pytest.mark.slow_chaos

FRAMES = 10_000
_TARGET = RemoteTarget("r", "127.0.0.1", 5600, "d", "e", 1, [[1, 2], [3]])
VALID = [
    encode(Hello(compat_hash="x" * 16, engine_id="p", role=Role.PREFILL, epoch="e")),
    encode(
        Done(
            request="r",
            sender_engine="p",
            sender_rank=0,
            target_rank=0,
            epoch="e",
            status=Status.DONE,
            groups=[0, 1],
            bytes=10,
        )
    ),
    encode(AddSend(rank=0, request="r", prompt_len=10, block_ids=[[1]], remote=_TARGET)),
    encode(ExpectRecv(rank=0, request="r", prompt_len=10, block_ids=[[1]], prefill_tp=2)),
    encode(BeginStep(rank=0, step=1, slices=[StepSlice("r", 0, 10)])),
    encode(LayerReady(rank=0, step=1, layer=3)),
    encode(GetFinished(rank=0)),
]
TAGS = [
    "hello",
    "done",
    "ack",
    "abort",
    "add_send",
    "expect_recv",
    "begin_step",
    "layer_ready",
    "get_finished",
    "abort_request",
    "register",
    "pool_save",
    "ping",
    "claim",
    "new_epoch",
]
FIELDS = [
    "rank",
    "request",
    "step",
    "layer",
    "slices",
    "block_ids",
    "remote",
    "prompt_len",
    "epoch",
    "status",
    "groups",
    "bytes",
    "engine_id",
    "compat_hash",
    "role",
    "reason",
    "prefill_tp",
    "timeout_s",
    "sender_rank",
    "target_rank",
    "shm_names",
]
# msgpack headers that announce far more than follows: str32, bin32, array32, map32, ext32.
HUGE = [
    b"\xdb\xff\xff\xff\xff",
    b"\xc6\x7f\xff\xff\xff",
    b"\xdd\xff\xff\xff\xff",
    b"\xdf\xff\xff\xff\xff",
    b"\xc9\xff\xff\xff\xf0\x01",
]


def _junk(rng: random.Random, depth: int = 0) -> Any:
    pick = rng.randrange(9 if depth < 2 else 6)
    return [
        lambda: rng.randint(-(2**63), 2**64 - 1),
        lambda: rng.random() * 1e300 * rng.choice([-1, 1]),
        lambda: float("nan"),
        lambda: None,
        lambda: rng.randbytes(rng.randrange(8)),
        lambda: "é" * rng.randrange(4),
        lambda: [_junk(rng, depth + 1) for _ in range(rng.randrange(3))],
        lambda: {str(rng.randrange(9)): _junk(rng, depth + 1)},
        lambda: [[-1]],
    ][pick]()


def _payload(rng: random.Random, kind: int) -> bytes:
    if kind == 0:  # random bytes
        return rng.randbytes(rng.randrange(300))
    if kind == 1:  # a real message cut short
        v = rng.choice(VALID)
        return v[: rng.randrange(len(v))]
    if kind == 2:  # huge lengths, alone or as a field of a real tag
        head = rng.choice(HUGE)
        if rng.random() < 0.5:
            return head + rng.randbytes(rng.randrange(16))
        return b"\x82\xa4type\xaaadd_send\xa9block_ids" + head + rng.randbytes(8)
    if kind == 3:  # real tags, wrong field types
        msg = {"type": rng.choice(TAGS), "version": PROTOCOL_VERSION}
        for f in rng.sample(FIELDS, rng.randrange(1, 7)):
            msg[f] = _junk(rng)
        return msgspec.msgpack.encode(msg)
    if kind == 4:  # deep nesting
        depth = rng.choice([64, 1000, 100_000])
        return b"\x91" * depth + b"\xc0"
    if kind == 5:  # unknown versions of real messages
        v = msgspec.msgpack.decode(rng.choice(VALID))
        v["version"] = rng.choice([0, 2, 99, -1, 2**40, "1", None])
        return msgspec.msgpack.encode(v)
    # not a map at all, or an unknown tag
    return msgspec.msgpack.encode(
        rng.choice(
            [
                [1, 2, 3],
                7,
                "hello",
                {"type": "nope", "version": PROTOCOL_VERSION},
                {"version": PROTOCOL_VERSION},
            ]
        )
    )


def garbage(
    n: int, seed: int, *, oversize: bool, seal: Callable[[bytes], bytes] | None = None
) -> list[list[bytes]]:
    """``n`` multipart frames none of which is a valid message; ``seal``: applied to every
    other payload."""
    rng = random.Random(seed)
    out: list[list[bytes]] = []
    while len(out) < n:
        i = len(out)
        corr = ONE_WAY if rng.random() < 0.3 else rng.randbytes(8)
        if i % 10 == 9:  # bad framing: a corr id that is not 8 bytes, no payload, extra parts
            out.append(
                rng.choice(
                    [
                        [rng.randbytes(rng.randrange(8))],
                        [rng.randbytes(rng.choice([0, 7, 9])), rng.randbytes(20)],
                        [corr, b"", b"extra"],
                        [corr],
                    ]
                )
            )
            continue
        if oversize and i % 1000 == 500:  # over the 1 MiB cap, under the hard cap
            out.append([corr, b"\x00" * (1536 << 10)])
            continue
        payload = _payload(rng, i % 7)
        try:
            decode(payload)
        except Exception:
            out.append([corr, seal(payload) if seal and i % 2 else payload])
    return out


class Flood(threading.Thread):
    """Sends the frames from a DEALER, reads whatever comes back, and checks ``/livez``
    every 1,000 frames."""

    def __init__(self, endpoint: str, frames: list[list[bytes]], admin: str) -> None:
        super().__init__(daemon=True)
        self.endpoint, self.frames, self.admin = endpoint, frames, admin
        self.sent = self.replies = 0
        self.livez: list[tuple[int, float]] = []  # (status, seconds)
        self.started_at = self.ended_at = 0.0
        self.error: BaseException | None = None

    def run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(self.endpoint)
        self.started_at = time.monotonic()
        try:
            deadline = self.started_at + 120
            for i, parts in enumerate(self.frames):
                while True:
                    try:
                        sock.send_multipart(parts, zmq.NOBLOCK)
                        break
                    except zmq.Again:
                        assert time.monotonic() < deadline, "the socket stopped taking frames"
                        self._drain(sock, 10)
                self.sent += 1
                self._drain(sock, 0)
                if i % 1000 == 999:
                    t = time.monotonic()
                    code = httpx.get(f"{self.admin}/livez", timeout=10).status_code
                    self.livez.append((code, time.monotonic() - t))
            self._drain(sock, 500)
        except BaseException as e:  # reported by the test
            self.error = e
        finally:
            self.ended_at = time.monotonic()
            ctx.destroy(0)

    def _drain(self, sock: zmq.Socket[bytes], timeout_ms: int) -> None:
        while sock.poll(timeout_ms):
            sock.recv_multipart()
            self.replies += 1
            timeout_ms = 0


@pytest.mark.parametrize("target", ["control", "engine"])
def test_malformed_frames_during_a_transfer(chaos: Callable[..., Chaos], target: str) -> None:
    # The control port of decode (prefill's Hello / Done arrive there) or the engine socket of
    # prefill (its engine's layer signals arrive there).
    role = "decode" if target == "control" else "prefill"
    ch = chaos(
        f"{FRAMES} malformed frames at {role} {target}",
        engine_link_timeout_s=10.0,
        engine_link_lease_s=None,
    )
    side = ch.side(role)
    endpoint = f"tcp://127.0.0.1:{side.control_port}" if target == "control" else side.ipc
    before = metric_sum(side.admin_url, "rejected", target)
    control = target == "control"
    seal = FrameAuth(user_key()).seal if control else None
    flood = Flood(endpoint, garbage(FRAMES, 7, oversize=control, seal=seal), side.admin_url)
    flood.start()
    ch.fault_at = time.monotonic()
    ch.start(LENS, deadline_s=60)
    ch.collect()
    flood.join(150)
    assert not flood.is_alive() and flood.error is None, flood.error
    transfer_end = ch.replies["decode"]["arrived_at"]
    rejected = before
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:  # the sidecar may still be working through its queue
        rejected = metric_sum(side.admin_url, "rejected", target)
        if rejected - before >= flood.sent:
            break
        time.sleep(0.5)
    grew = int(rejected - before)
    ch.notes.append(
        f"rejected +{grew} of {flood.sent} sent in {flood.ended_at - flood.started_at:.1f}s, "
        f"{flood.replies} error replies"
    )

    def expect(o: Outcome) -> list[str]:
        out = []
        for r in ("prefill", "decode"):
            if set(o.status[r].values()) != {"DONE"}:
                out.append(f"scenario: the transfer should end DONE on {r}: {o.status[r]}")
        if not flood.started_at < transfer_end:
            out.append("scenario: the flood did not overlap the transfer")
        if grew <= 0:
            out.append(f"scenario: the rejected-frames counter of {role} {target} did not grow")
        bad = [c for c, _ in flood.livez if c != 200]
        if bad or len(flood.livez) != FRAMES // 1000:
            out.append(f"scenario: /livez during the flood answered {flood.livez}")
        return out

    ch.verify(expect=expect)
