"""``Done`` and the answer to decode's ``Abort`` wait until none of the request's writes is on
the wire; the wait wakes when the last write leaves it (no polling) and gives up at the send
deadline."""

from __future__ import annotations

import asyncio

from app.kvcache.desc import LayoutDesc
from app.transfer.wire.protocol import Abort, Done, Status
from tests.transfer.conftest import D_ENDPOINT, D_ENGINE, Prefill, make_prefill


async def test_drain_wakes_as_the_last_write_leaves_the_wire(prefill: Prefill) -> None:
    assert (await prefill.add()).ok
    assert prefill.pin("r1") == ["r1"]
    assert prefill.pin("r1") == ["r1"]
    req = prefill.req()
    waiter = asyncio.ensure_future(prefill.side.drained(req))
    await asyncio.sleep(0.01)
    prefill.side.unpin(prefill.agent, ["r1"])
    await asyncio.sleep(0.01)
    assert not waiter.done()
    prefill.side.unpin(prefill.agent, ["r1"])
    for _ in range(3):  # the wake-up callback, then the waiter: no timer involved
        await asyncio.sleep(0)
    assert waiter.done() and waiter.result() is True


async def test_done_is_sent_only_after_the_writes_drained(prefill: Prefill) -> None:
    assert (await prefill.add()).ok
    assert prefill.pin("r1") == ["r1"]
    prefill.side.fail(prefill.req(), "a write failed")
    await asyncio.sleep(0.01)
    assert prefill.net.sent(Done) == []  # a write is still on the wire
    prefill.side.unpin(prefill.agent, ["r1"])
    await prefill.tasks.settle()
    [done] = prefill.net.sent(Done, D_ENDPOINT)
    assert done.status is Status.FAILED


async def test_abort_from_decode_is_answered_after_the_writes_drained(prefill: Prefill) -> None:
    assert (await prefill.add()).ok
    assert prefill.pin("r1") == ["r1"]
    answer = asyncio.ensure_future(prefill.side.aborted_by_decode("r1", D_ENGINE, "gone"))
    await asyncio.sleep(0.01)
    assert prefill.req().state is Status.ABORTED
    assert not answer.done()
    prefill.side.unpin(prefill.agent, ["r1"])
    await asyncio.wait_for(answer, 1.0)


async def test_abort_from_another_decode_is_ignored(prefill: Prefill) -> None:
    assert (await prefill.add()).ok
    await prefill.side.aborted_by_decode("r1", "decode-b", "forged")
    assert not prefill.req().state.terminal


async def test_engine_abort_tells_decode_after_the_writes_drained(prefill: Prefill) -> None:
    assert (await prefill.add()).ok
    assert prefill.pin("r1") == ["r1"]
    abort = asyncio.ensure_future(prefill.side.abort(0, "r1", "client gone", notify=True))
    await asyncio.sleep(0.01)
    assert prefill.net.sent(Abort) == []
    prefill.side.unpin(prefill.agent, ["r1"])
    assert await asyncio.wait_for(abort, 1.0)
    [msg] = prefill.net.sent(Abort, D_ENDPOINT)
    assert msg.request == "r1"
    await prefill.tasks.settle()
    assert prefill.net.sent(Done) == []  # the Abort replaces the Done


async def test_drain_gives_up_at_the_send_deadline(layout: LayoutDesc) -> None:
    p = make_prefill(layout, send_timeout_s=0.05)
    assert (await p.add()).ok
    assert p.pin("r1") == ["r1"]
    assert await asyncio.wait_for(p.side.drained(p.req()), 1.0) is False
    await p.tasks.cancel()
