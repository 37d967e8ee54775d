"""Prefill reports each send to every decode rank it wrote to with one ``Done``: retried when
the ack is lost (decode counts a repeat once), ABORTED when decode says it aborted, and not sent
at all to a decode that is gone."""

from __future__ import annotations

from app.transfer.wire.protocol import Ack, Done, Msg, Status
from tests.transfer.conftest import D_ENDPOINT, Prefill


async def test_done_of_a_finished_send(prefill: Prefill) -> None:
    assert (await prefill.add()).ok
    await prefill.side.send_done(prefill.req())
    [done] = prefill.net.sent(Done, D_ENDPOINT)
    assert done.status is Status.DONE and done.epoch == "d-epoch-1"
    assert prefill.req().state is Status.DONE
    assert all(g.done == 1 for g in prefill.agent.groups.values())


async def test_lost_ack_is_retried(prefill: Prefill) -> None:
    assert (await prefill.add()).ok
    answers: list[Msg | None] = [None, Ack(request="r1")]
    prefill.stub.done = lambda _m: answers.pop(0)
    await prefill.side.send_done(prefill.req())
    assert len(prefill.net.sent(Done)) == 2
    assert prefill.req().state is Status.DONE


async def test_done_never_acked_fails_the_send(prefill: Prefill) -> None:
    assert (await prefill.add()).ok
    prefill.stub.done = lambda _m: None
    await prefill.side.send_done(prefill.req())
    assert len(prefill.net.sent(Done)) == 3
    assert prefill.req().state is Status.FAILED


async def test_done_refused_as_aborted_ends_aborted(prefill: Prefill) -> None:
    assert (await prefill.add()).ok
    prefill.stub.done = lambda m: Ack(request=m.request, ok=False, error="aborted at decode")
    await prefill.side.send_done(prefill.req())
    assert prefill.req().state is Status.ABORTED
    assert all(g.done == 0 for g in prefill.agent.groups.values())


async def test_no_done_to_a_lost_decode(prefill: Prefill) -> None:
    assert (await prefill.add()).ok
    peer = prefill.peers.table[D_ENDPOINT]
    await prefill.side.peer_lost(peer, "lease ran out")
    await prefill.side.send_done(prefill.req())  # as a late write result would
    await prefill.tasks.settle()
    assert prefill.req().state is Status.FAILED and prefill.req().peer_lost
    assert prefill.net.sent(Done) == []


async def test_new_decode_generation_ends_only_sends_to_its_old_memory(prefill: Prefill) -> None:
    assert (await prefill.add("old")).ok
    prefill.stub.epoch = "d-epoch-2"
    assert (await prefill.add("new", epoch="d-epoch-2")).ok
    peer = prefill.peers.table[D_ENDPOINT]
    await prefill.side.peer_lost(peer, "decode started a new generation", epoch="d-epoch-1")
    assert prefill.req("old").state is Status.FAILED
    assert not prefill.req("new").state.terminal
