"""A flood of bad frames or failing requests is one log line per kind per interval, with a count."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import pytest
import zmq
import zmq.asyncio

from app.transfer.control.framing import ONE_WAY
from app.transfer.control.server import ControlServer
from app.transfer.wire.codec import encode
from app.transfer.wire.protocol import AnyMsg, GetFinished, Msg

pytestmark = pytest.mark.timeout(30)

LOGGER = "app.transfer.control"


async def failing(msg: AnyMsg, peer: bytes) -> Msg | None:
    raise RuntimeError(f"no such request: {type(msg).__name__}")


@pytest.fixture
async def flood() -> AsyncIterator[tuple[ControlServer, zmq.asyncio.Socket]]:
    ctx = zmq.asyncio.Context()
    # A short interval keeps the test short.
    server = ControlServer(ctx, "tcp://127.0.0.1:0", failing, name="flooded", log_interval_s=0.5)
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(await server.start())
    try:
        yield server, raw
    finally:
        raw.close(linger=0)
        await server.stop()
        ctx.destroy(linger=0)


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


async def test_flood_is_one_line_per_kind_then_a_count(
    flood: tuple[ControlServer, zmq.asyncio.Socket], caplog: pytest.LogCaptureFixture
) -> None:
    server, raw = flood
    caplog.set_level(logging.WARNING, logger=LOGGER)
    for _ in range(500):
        await raw.send_multipart([ONE_WAY, b"\xa1\xff"])
    await until(lambda: server.rejected == 500)
    first = lines(caplog)
    assert len(first) == 1 and "rejected a frame" in first[0], first

    # Past the interval, the next line says how many were held back.
    await asyncio.sleep(0.6)
    await raw.send_multipart([ONE_WAY, b"\xa1\xff"])
    await until(lambda: server.rejected == 501)
    assert len(lines(caplog)) == 2
    assert "(499 more like it in the last 0.5s not logged)" in lines(caplog)[-1]


async def test_failing_handler_flood_is_throttled_too(
    flood: tuple[ControlServer, zmq.asyncio.Socket], caplog: pytest.LogCaptureFixture
) -> None:
    server, raw = flood
    caplog.set_level(logging.WARNING, logger=LOGGER)
    for _ in range(300):
        await raw.send_multipart([ONE_WAY, encode(GetFinished(rank=0))])
    await until(lambda: server.handler_errors == 300)
    handler_lines = [m for m in lines(caplog) if "handler failed" in m]
    assert len(handler_lines) == 1, handler_lines
