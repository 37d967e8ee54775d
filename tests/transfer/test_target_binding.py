"""A send takes only the target decode signed for its own transfer: from the engine link a
well-signed target of another transfer (in ``AddSend``, or ``SetTarget`` after the router
handed it over) ends the send FAILED naming both ids, nothing is connected to, and the
transfer the target was signed for still waits for it and takes it."""

from __future__ import annotations

from app.transfer.wire.protocol import AddSend, Reply, SetTarget, Status
from tests.transfer.conftest import PROMPT_DIGEST, Prefill, ids, target


async def test_send_admitted_with_another_transfers_target_fails_unconnected(
    prefill: Prefill,
) -> None:
    msg = AddSend(
        rank=0,
        request="r1",
        prompt_len=40,
        block_ids=ids([7, 8, 9]),
        remote=target("r2"),
        prompt_digest=PROMPT_DIGEST,
    )
    reply = await prefill.side.add(msg)
    await prefill.tasks.settle()
    assert isinstance(reply, Reply) and not reply.ok, reply
    assert "signed for transfer 'r2' was posted for 'r1'" in (reply.error or "")
    assert prefill.net.links == []  # decode's sidecar was not even connected to
    assert prefill.req().state is Status.FAILED


async def test_another_transfers_target_from_the_engine_is_not_taken(prefill: Prefill) -> None:
    assert await prefill.add("r1", waiting=True) == Reply()
    assert await prefill.add("r2", waiting=True) == Reply()
    reply = prefill.side.set_target(SetTarget(rank=0, request="r1", remote=target("r2")))
    await prefill.tasks.settle()
    assert not reply.ok and "signed for transfer 'r2' was posted for 'r1'" in (reply.error or "")
    assert prefill.net.links == []
    r1 = prefill.req("r1")
    assert r1.state is Status.FAILED and "'r2'" in r1.error
    # r2 was not touched: it still waits, and its own target is taken.
    r2 = prefill.req("r2")
    assert r2.waiting and not r2.peer and not r2.state.terminal
    assert prefill.side.set_target(SetTarget(rank=0, request="r2", remote=target("r2"))).ok
    await prefill.tasks.settle()
    assert prefill.net.links and prefill.req("r2").state is not Status.FAILED
