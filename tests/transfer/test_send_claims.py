"""Prefill admits a send only after decode accepted its claim of the target's blocks (decode
must know the writer before the first byte lands); a refusal ends the send and decode hears of
it instead of waiting for its deadline."""

from __future__ import annotations

from app.transfer.wire.protocol import Ack, Claim, Done, Hello, Status
from tests.transfer.conftest import D_ENDPOINT, D_EPOCH, MINE, P_ENGINE, Prefill


async def test_send_is_admitted_once_decode_accepted_the_claim(prefill: Prefill) -> None:
    reply = await prefill.add()
    assert reply.ok, reply.error
    [hello, claim] = [m for _, m in prefill.net.asked]
    assert isinstance(hello, Hello)
    assert isinstance(claim, Claim)
    assert (claim.request, claim.sender_engine, claim.sender_rank) == ("r1", P_ENGINE, 0)
    assert (claim.epoch, claim.block_ids) == (D_EPOCH, MINE)
    assert prefill.req().d_ranks == {0: frozenset(g.index for g in prefill.agent.desc.groups)}


async def test_refused_claim_fails_the_send_and_tells_decode(prefill: Prefill) -> None:
    prefill.stub.claim = lambda m: Ack(request=m.request, ok=False, error="not yours")
    reply = await prefill.add()
    assert not reply.ok and "refused the request: not yours" in (reply.error or "")
    await prefill.tasks.settle()
    req = prefill.req()
    assert req.state is Status.FAILED
    [done] = prefill.net.sent(Done, D_ENDPOINT)
    assert done.status is Status.FAILED  # decode ends the request now, not at its deadline


async def test_target_of_an_old_decode_epoch_is_refused(prefill: Prefill) -> None:
    reply = await prefill.add(epoch="d-epoch-0")
    assert not reply.ok and "restarted" in (reply.error or "")
    assert prefill.net.sent(Claim) == []


async def test_send_to_a_new_decode_epoch_handshakes_again(prefill: Prefill) -> None:
    assert (await prefill.add("r1")).ok
    prefill.stub.epoch = "d-epoch-2"
    assert (await prefill.add("r2", epoch="d-epoch-2")).ok
    assert len(prefill.net.sent(Hello)) == 2
    assert prefill.net.sent(Claim)[-1].epoch == "d-epoch-2"


async def test_decode_that_never_answers_leaves_no_peer_behind(prefill: Prefill) -> None:
    del prefill.net.answers[D_ENDPOINT]
    assert not (await prefill.add()).ok
    assert prefill.peers.table == {}
    assert all(link.closed for link in prefill.net.links)


async def test_duplicate_or_late_send_is_refused(prefill: Prefill) -> None:
    assert (await prefill.add()).ok
    assert "already in flight" in ((await prefill.add()).error or "")
    prefill.side.admitting = False
    assert "shutting down" in ((await prefill.add("r2")).error or "")


async def test_ended_send_is_not_written(prefill: Prefill) -> None:
    assert (await prefill.add()).ok
    prefill.side.fail(prefill.req(), "engine aborted")
    assert prefill.pin("r1") == []
