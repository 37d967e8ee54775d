"""Abort replaces Done: once prefill's engine aborts a send (``SendSide.abort(..., notify=True)``),
decode hears one ``Abort`` for it and never a ``Done``, whatever the writes of its last layer do
afterwards. A Done after the Abort would tell decode the request completed (or ended) twice, and
decode may already have handed the blocks back to its engine.

The stream thread is played by hand here: the test takes the layer tasks the engine's signals
queued, pins them (writes on the wire), reports each layer landed, and unpins, in the order each
race needs.
"""

from __future__ import annotations

import asyncio
import queue
from typing import cast

from app.transfer.requests.stream import LayerResult, LayerTask, StreamThread
from app.transfer.wire.protocol import Abort, BeginStep, Done, LayerReady, Reply, Status, StepSlice
from tests.transfer.conftest import D_ENDPOINT, Prefill, until


class Wire:
    """Stands in for the stream thread of ``prefill``'s rank."""

    def __init__(self, p: Prefill) -> None:
        self.p = p
        self.queue: queue.Queue[LayerTask | None] = queue.Queue()
        p.agent.stream = cast(StreamThread, self)  # layer_ready only puts on ``queue``

    async def final_step(self, rid: str = "r1", prompt_len: int = 40) -> list[LayerTask]:
        """The engine runs the prompt in one step and signals every layer of it."""
        side, agent = self.p.side, self.p.agent
        side.begin_step(BeginStep(rank=0, step=1, slices=[StepSlice(rid, 0, prompt_len)]))
        for pl in agent.desc.placements:
            await side.layer_ready(LayerReady(rank=0, step=1, layer=pl.layer))
        tasks = []
        while not self.queue.empty():
            task = self.queue.get_nowait()
            assert task is not None
            tasks.append(task)
        assert tasks and agent.sends[rid].final_layers_left == len(tasks)
        return tasks

    def pin(self, tasks: list[LayerTask], rid: str = "r1") -> None:
        """The writes of ``tasks`` go on the wire."""
        for task in tasks:
            for batch in task.batches:
                assert self.p.side.pin(self.p.agent, batch.endpoint, [rid]) == [rid]

    def land(self, tasks: list[LayerTask], rid: str = "r1") -> None:
        """Every write of ``tasks`` completed: one result per layer, as the stream reports."""
        groups = {pl.layer: pl.group for pl in self.p.agent.desc.placements}
        for task in tasks:
            result = LayerResult(
                task.step, task.layer, groups[task.layer], [rid], {}, {rid: 64}, 64, 1, 1, 0.0
            )
            self.p.side.layer_done(self.p.agent, result)

    def unpin(self, tasks: list[LayerTask], rid: str = "r1") -> None:
        for task in tasks:
            for _ in task.batches:
                self.p.side.unpin(self.p.agent, [rid])


async def admit(p: Prefill) -> None:
    reply = await p.add()
    assert isinstance(reply, Reply) and reply.ok, reply


def assert_abort_only(p: Prefill) -> None:
    """Decode was told once, with an Abort; no Done, and nothing counted as done."""
    assert [m.request for m in p.net.sent(Abort, D_ENDPOINT)] == ["r1"]
    assert p.net.sent(Done) == [], [(d.status, d.request) for d in p.net.sent(Done)]
    assert p.req().state is Status.ABORTED
    assert all(g.done == 0 for g in p.agent.groups.values())


async def test_last_layer_landing_after_the_abort_sends_no_done(prefill: Prefill) -> None:
    """The engine aborts while the last layer's writes are on the wire; they land, then the
    Abort goes out (after the drain), and the landing does not start a Done."""
    wire = Wire(prefill)
    await admit(prefill)
    tasks = await wire.final_step()
    wire.pin(tasks)
    abort = asyncio.ensure_future(prefill.side.abort(0, "r1", "client gone", notify=True))
    await until("the abort ended the send", lambda: prefill.req().state is Status.ABORTED)
    assert prefill.net.sent(Abort) == []  # a write is still on the wire
    wire.land(tasks)
    wire.unpin(tasks)
    assert await asyncio.wait_for(abort, 1.0)
    await prefill.tasks.settle()
    assert_abort_only(prefill)


async def test_abort_cancels_the_done_the_last_layer_already_asked_for(prefill: Prefill) -> None:
    """The last layer's report reached the loop just before the engine's abort: its Done is
    queued but has not run. The Abort replaces it."""
    wire = Wire(prefill)
    await admit(prefill)
    tasks = await wire.final_step()
    wire.pin(tasks)
    wire.land(tasks)  # spawns the Done, which has not run yet
    wire.unpin(tasks)
    # No await yields between the landing and the abort: the Done runs after it.
    assert await prefill.side.abort(0, "r1", "client gone", notify=True)
    await prefill.tasks.settle()
    assert_abort_only(prefill)


async def test_abort_while_the_done_waits_for_the_drain(prefill: Prefill) -> None:
    """The last layer landed and its Done waits for the writes to leave the wire (the stream
    thread reports a layer before it unpins it); the engine aborts during that wait."""
    wire = Wire(prefill)
    await admit(prefill)
    tasks = await wire.final_step()
    wire.pin(tasks)
    wire.land(tasks)
    await asyncio.sleep(0.01)  # the Done starts and waits for the drain
    assert prefill.net.sent(Done) == [] and not prefill.req().state.terminal
    abort = asyncio.ensure_future(prefill.side.abort(0, "r1", "client gone", notify=True))
    await until("the abort ended the send", lambda: prefill.req().state is Status.ABORTED)
    wire.unpin(tasks)
    assert await asyncio.wait_for(abort, 1.0)
    await prefill.tasks.settle()
    assert_abort_only(prefill)
