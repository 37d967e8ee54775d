"""ControlServer's receive loop on a plain ROUTER (no ``zmq.asyncio``): it sleeps on the
socket's descriptor between messages, and replies sent from handler tasks while others arrive
lose no message's wake-up (ZMQ's descriptor signals edges). Real ZMQ sockets."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from app.engine_link.sync_client import SyncClient
from app.transfer.control.client import PeerClient
from app.transfer.control.server import ControlServer
from app.transfer.wire.protocol import Ack, AnyMsg, GetFinished, Hello, Msg, Role

pytestmark = pytest.mark.timeout(30)


def hello(engine_id: str) -> Hello:
    return Hello(compat_hash="c", engine_id=engine_id, role=Role.DECODE)


async def test_an_idle_server_waits_without_cpu(ctx: zmq.asyncio.Context) -> None:
    """Between messages the receive loop sleeps on the socket's descriptor (no polling), and
    answers the next message at once."""

    async def handler(msg: AnyMsg, peer: bytes) -> Msg | None:
        return Ack(request="ok")

    server = ControlServer(ctx, "tcp://127.0.0.1:0", handler, name="t", inline=(GetFinished,))
    await server.start()
    c = PeerClient(ctx, server.endpoint or "")
    try:
        assert await c.request(GetFinished(rank=0), 5.0) == Ack(request="ok")
        cpu0 = time.thread_time()
        await asyncio.sleep(1.0)
        spent = time.thread_time() - cpu0  # this thread runs the loop
        assert spent < 0.1, f"an idle server's loop spent {spent:.2f} s of CPU in 1 s"
        t0 = time.monotonic()
        assert await c.request(hello("after"), 5.0) == Ack(request="ok")
        assert time.monotonic() - t0 < 1.0
    finally:
        await c.close()
        await server.stop()


async def test_replies_from_tasks_do_not_lose_wakeups(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Many clients, each alternating a task-handled request with inline polls: every call is
    answered well within its deadline, so no message sat unseen behind a consumed edge."""

    async def handler(msg: AnyMsg, peer: bytes) -> Msg | None:
        if isinstance(msg, Hello):
            await asyncio.sleep(0.001)  # answered later, from its task
        return Ack(request=type(msg).__name__)

    server = ControlServer(ctx, f"ipc://{tmp_path}/e.sock", handler, inline=(GetFinished,))
    await server.start()

    def client(n: int) -> list[float]:
        link = SyncClient(server.endpoint or "")
        worst = []
        try:
            for i in range(n):
                msg: Msg = hello(f"h{i}") if i % 2 else GetFinished(rank=0)
                t0 = time.monotonic()
                assert link.request(msg, 5.0) == Ack(request=type(msg).__name__)
                worst.append(time.monotonic() - t0)
        finally:
            link.close()
        return worst

    try:
        times = await asyncio.gather(*(asyncio.to_thread(client, 300) for _ in range(4)))
    finally:
        await server.stop()
    slowest = max(max(t) for t in times)
    assert slowest < 2.0, f"a call took {slowest:.2f} s: a message waited unseen"
