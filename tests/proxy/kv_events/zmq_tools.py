"""Async helpers for the tests that run a subscriber over real ZMQ."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import zmq
import zmq.asyncio

from tests.proxy.kv_events.engine import free_port


async def until(what: str, fn: Callable[[], Any], timeout_s: float = 15.0) -> Any:
    """Poll ``fn`` until truthy; fail the test after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last: Any = None
    while loop.time() < deadline:
        last = fn()
        if last:
            return last
        await asyncio.sleep(0.05)
    pytest.fail(f"timed out after {timeout_s:g}s waiting for {what} (last: {last!r})")


@contextlib.asynccontextmanager
async def relay(upstream: str, drop: set[int]) -> AsyncIterator[str]:
    """A PUB that forwards ``upstream``'s messages except the batches numbered in ``drop``
    (a network that lost them); yields its endpoint."""
    ctx = zmq.asyncio.Context()
    sub, pub = ctx.socket(zmq.SUB), ctx.socket(zmq.PUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(upstream)
    port = free_port()
    pub.bind(f"tcp://127.0.0.1:{port}")

    async def forward() -> None:
        while True:
            frames = await sub.recv_multipart()
            if int.from_bytes(frames[1], "big") not in drop:
                await pub.send_multipart(frames)

    task = asyncio.create_task(forward())
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        ctx.destroy(linger=0)
