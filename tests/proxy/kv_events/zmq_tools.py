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


class Link:
    """A PUB in front of ``upstream`` whose connection to its subscribers can be cut and
    restored (a network that went away and came back): ``cut`` closes its PUB, so the
    subscriber's connection drops and what the upstream publishes meanwhile is lost; ``restore``
    binds it again on the same port, and the subscriber reconnects by itself."""

    def __init__(self, upstream: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(upstream)
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.pub: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Link:
        await self.restore()
        self._task = asyncio.create_task(self._forward())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.ctx.destroy(linger=0)

    async def _forward(self) -> None:
        while True:
            frames = await self.sub.recv_multipart()
            if self.pub is not None:
                await self.pub.send_multipart(frames)

    def cut(self) -> None:
        assert self.pub is not None
        self.pub.close(linger=0)
        self.pub = None

    async def restore(self, timeout_s: float = 5.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        pub = self.ctx.socket(zmq.PUB)
        while True:  # the closed PUB's listener is released by ZMQ's I/O thread, a bit later
            try:
                pub.bind(self.endpoint)
                break
            except zmq.ZMQError:
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(0.05)
        self.pub = pub
