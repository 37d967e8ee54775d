"""No write lands in released blocks: a send whose write is still on the wire when its deadline
passes tells decode nothing (no Done, no Ack to decode's Abort, no Abort) and keeps prefill's
source blocks from the engine, until Mooncake confirms or fails that write; then it does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from app.kvcache.desc import LayoutDesc
from app.transfer.wire.protocol import Done, Status
from tests.transfer.conftest import D_ENGINE, Prefill, make_prefill, until

# The send deadline, in real seconds: the drain's wait runs on the loop's clock.
DEADLINE_S = 0.2


@pytest.fixture
async def pinned(layout: LayoutDesc) -> AsyncIterator[Prefill]:
    """A send to decode whose one write is on the wire and never answered by Mooncake."""
    p = make_prefill(layout, send_timeout_s=DEADLINE_S)
    assert (await p.add()).ok
    await p.tasks.settle()
    assert p.pin("r1") == ["r1"]
    yield p
    await p.tasks.cancel()


async def test_failed_send_tells_decode_only_once_its_write_is_confirmed(
    pinned: Prefill,
) -> None:
    p = pinned
    p.side.fail(p.req(), "layer write failed")
    await asyncio.sleep(3 * DEADLINE_S)  # well past the send deadline
    assert p.net.sent(Done) == []  # decode would free the blocks the write lands in
    assert p.agent.finished() == ([], [], [])  # the engine would reuse the source blocks
    p.side.unpin(p.agent, ["r1"])  # Mooncake confirmed (or failed) the write
    await until("Done to decode", lambda: bool(p.net.sent(Done)))
    (done,) = p.net.sent(Done)
    assert done.status is Status.FAILED
    _, _, failed = p.agent.finished()
    assert [f.request for f in failed] == ["r1"]
    assert p.side.unconfirmed == 1


async def test_decode_abort_is_answered_only_once_the_write_is_confirmed(
    pinned: Prefill,
) -> None:
    p = pinned
    # Decode expired the request and asks whether anything is still on the wire; the control
    # server acks once this returns.
    answer = asyncio.create_task(p.side.aborted_by_decode("r1", D_ENGINE, "expired"))
    await asyncio.sleep(3 * DEADLINE_S)
    assert not answer.done()
    assert p.req().state is Status.ABORTED
    assert p.agent.finished() == ([], [], [])  # the source blocks are still read from
    p.side.unpin(p.agent, ["r1"])
    await asyncio.wait_for(answer, 2)
    _, _, failed = p.agent.finished()
    assert [f.request for f in failed] == ["r1"]
