"""Concurrent dispatch at the send side: a send admitted before decode's target keeps the
layers the engine signals (nothing written, nothing claimed), and once the target arrives it
claims decode's blocks, writes the backlog in signal order, each layer behind the gate its
first task opens, then writes new layers directly. Without a target it ends at its deadline
or on an abort, telling nobody (decode never heard of it)."""

from __future__ import annotations

from typing import Any

import pytest

from app.devices import CpuEvent
from app.devices.events import Gate
from app.transfer.requests.stream import LayerTask, StreamThread
from app.transfer.wire.protocol import (
    Abort,
    Ack,
    Claim,
    Done,
    Hello,
    SetTarget,
    Status,
)
from tests.transfer.conftest import D_ENDPOINT, Prefill, Stream, planned, step, target


async def set_target(prefill: Prefill, rid: str = "r1", **kw: Any) -> Any:
    reply = prefill.side.set_target(SetTarget(rank=0, request=rid, remote=target(rid, **kw)))
    await prefill.tasks.settle()
    return reply


async def test_waiting_send_claims_nothing_and_writes_nothing(
    prefill: Prefill, stream: Stream
) -> None:
    assert (await prefill.add(waiting=True)).ok
    await step(prefill, 1, 0, 16)
    assert prefill.net.asked == []  # no handshake, no claim: decode does not know of it yet
    held = stream.tasks()
    assert [t.layer for t in held] == [0, 1]
    assert all(t.batches == [] and isinstance(t.gate, Gate) for t in held)
    assert prefill.req().state is Status.PENDING and prefill.req().waiting


async def test_target_replays_the_backlog_in_order_behind_its_gates(
    prefill: Prefill, stream: Stream
) -> None:
    assert (await prefill.add(waiting=True)).ok
    await step(prefill, 1, 0, 16)
    await step(prefill, 2, 16, 40)  # the prompt's end: the final step
    held = stream.tasks()
    assert (await set_target(prefill)).ok
    [claim] = prefill.net.sent(Claim, D_ENDPOINT)
    assert claim.request == "r1"
    replay = stream.tasks()
    assert [(t.step, t.layer) for t in replay] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert [t.event for t in replay] == [t.gate for t in held]  # each waits for its layer
    assert [planned(t) for t in replay] == [[("r1", 0, 16)]] * 2 + [[("r1", 16, 40)]] * 2
    req = prefill.req()
    assert not req.waiting and req.final_step == 2 and req.final_layers_left == 2
    # From now on a signal writes directly, with its own event.
    await step(prefill, 3, 40, 40)
    assert all(t.batches and t.gate is None for t in stream.tasks())


async def test_target_skips_what_decode_already_holds(prefill: Prefill, stream: Stream) -> None:
    assert (await prefill.add(waiting=True)).ok
    await step(prefill, 1, 0, 16)
    await step(prefill, 2, 16, 40)
    stream.tasks()
    assert (await set_target(prefill, computed=16)).ok
    # Step 1 lies wholly in decode's prefix cache: nothing of it is planned.
    assert [planned(t) for t in stream.tasks()] == [[("r1", 16, 40)]] * 2


async def test_refused_claim_fails_the_send_and_tells_decode(
    prefill: Prefill, stream: Stream
) -> None:
    prefill.stub.claim = lambda m: Ack(request=m.request, ok=False, error="not yours")
    assert (await prefill.add(waiting=True)).ok
    await step(prefill, 1, 0, 16)
    stream.tasks()
    assert (await set_target(prefill)).ok  # answered at once; the claim follows
    assert prefill.req().state is Status.FAILED
    assert stream.tasks() == []  # the backlog is dropped, never written
    [done] = prefill.net.sent(Done, D_ENDPOINT)
    assert done.status is Status.FAILED


async def test_second_target_or_unknown_send_is_refused(prefill: Prefill, stream: Stream) -> None:
    assert (await prefill.add(waiting=True)).ok
    assert (await set_target(prefill)).ok
    again = await set_target(prefill)
    assert not again.ok and "already has a target" in again.error
    unknown = await set_target(prefill, "nope")
    assert not unknown.ok and "no send nope" in unknown.error


async def test_deadline_without_target_ends_it_telling_nobody(
    prefill: Prefill, stream: Stream
) -> None:
    assert (await prefill.add(waiting=True)).ok
    await step(prefill, 1, 0, 40)
    assert prefill.side.fail(prefill.req(), "deadline passed while sending", Status.EXPIRED)
    await prefill.tasks.settle()
    assert prefill.req().state is Status.EXPIRED
    assert prefill.net.asked == []
    late = await set_target(prefill)
    assert not late.ok and "already ended EXPIRED" in late.error


async def test_abort_without_target_tells_nobody(prefill: Prefill, stream: Stream) -> None:
    assert (await prefill.add(waiting=True)).ok
    assert await prefill.side.abort(0, "r1", "no target from decode", notify=True)
    assert prefill.req().state is Status.ABORTED
    assert prefill.net.sent(Abort) == [] and prefill.net.sent(Hello) == []


def test_stream_opens_the_gate_after_the_event_and_fails_it_with_the_event() -> None:
    class Failing:
        def synchronize(self) -> None:
            raise RuntimeError("device lost")

    results: list[Any] = []
    s = StreamThread("t", 4, lambda *a: None, results.append, lambda e, i: list(i), print)
    try:
        ok, bad = Gate(), Gate()
        s.put(LayerTask(1, 0, CpuEvent(), [], gate=ok), 1.0)
        s.put(LayerTask(1, 1, Failing(), [], gate=bad), 1.0)  # type: ignore[arg-type]
    finally:
        s.stop()
    ok.synchronize()
    with pytest.raises(Exception, match="device lost"):
        bad.synchronize()
