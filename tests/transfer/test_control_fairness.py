"""A flood on the control socket does not starve the sidecar's other tasks: the receive loop
gives the event loop a turn every few dozen frames it drains (transfers, the admin API, and a
client reading its replies in the same process share that loop). Real ZMQ sockets."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq
import zmq.asyncio

from app.transfer.control.framing import ONE_WAY
from app.transfer.control.server import ControlServer
from app.transfer.wire.codec import encode
from app.transfer.wire.protocol import Ack, AnyMsg, GetFinished, Msg

pytestmark = pytest.mark.timeout(30)

N_FRAMES = 2000


async def test_a_queued_flood_yields_to_other_tasks(ctx: zmq.asyncio.Context) -> None:
    """2,000 one-way polls wait in the socket before the loop looks; while the server drains
    them, another task runs at least once every 64 frames."""

    async def handler(msg: AnyMsg, peer: bytes) -> Msg | None:
        return Ack(request="ok")

    server = ControlServer(ctx, "tcp://127.0.0.1:0", handler, name="t", inline=(GetFinished,))
    endpoint = await server.start()
    sender: zmq.Socket[bytes] = zmq.Context.shadow(ctx.underlying).socket(zmq.DEALER)
    sender.setsockopt(zmq.LINGER, 0)
    sender.setsockopt(zmq.SNDHWM, 0)
    sender.connect(endpoint)
    payload = encode(GetFinished(rank=0))
    try:
        for _ in range(N_FRAMES):
            sender.send_multipart([ONE_WAY, payload])
        # The loop is held while ZMQ's I/O threads queue the frames at the server.
        time.sleep(0.5)
        deadline = time.monotonic() + 10.0
        gaps: list[int] = []
        seen = server.frames
        while server.frames < N_FRAMES and time.monotonic() < deadline:
            await asyncio.sleep(0)
            gaps.append(server.frames - seen)
            seen = server.frames
        assert server.frames == N_FRAMES, f"served {server.frames} of {N_FRAMES} frames"
        assert max(gaps) <= 64, f"the server drained {max(gaps)} frames without yielding"
    finally:
        sender.close(linger=0)
        await server.stop()
