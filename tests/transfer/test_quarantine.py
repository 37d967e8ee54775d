"""A decode request that ends any other way than DONE while a prefill that claimed it may still
be writing stays in quarantine (ended, not reported, blocks kept) until that prefill answers the
``Abort`` (it answers once nothing is on the wire), or its sidecar is gone, or
``quarantine_max_s`` passed. Silence alone is not enough."""

from __future__ import annotations

import asyncio

from app.transfer.wire.protocol import Abort, Ack, Msg, Status
from tests.transfer.conftest import P_ENDPOINT, P_ENGINE, TICK_S, Decode, until


def answer_later(decode: Decode) -> asyncio.Future[Ack]:
    """The prefill answers every Abort when the test resolves the returned future."""
    later: asyncio.Future[Ack] = asyncio.get_running_loop().create_future()

    def answer(msg: Msg) -> asyncio.Future[Ack] | None:
        return later if isinstance(msg, Abort) else None

    decode.net.answers[P_ENDPOINT] = answer
    return later


async def claimed_and_aborted(decode: Decode) -> None:
    decode.expect()
    decode.claim()
    assert await decode.side.abort(0, "r1", "client went away")


async def test_aborted_request_is_held_until_the_sender_answers(decode: Decode) -> None:
    later = answer_later(decode)
    await claimed_and_aborted(decode)
    req = decode.req()
    assert req.state is Status.ABORTED and req.quarantined_at is not None
    await until("the Abort to reach prefill", lambda: bool(decode.net.sent(Abort, P_ENDPOINT)))
    await asyncio.sleep(5 * TICK_S)
    assert decode.finished() == ([], [])  # held: the engine keeps the blocks
    later.set_result(Ack(request="r1"))
    await until("release", lambda: req.quarantined_at is None)
    assert decode.finished() == ([], ["r1"])
    assert decode.side.counters["quarantined"] == 1


async def test_silence_past_quarantine_max_releases(decode: Decode) -> None:
    answer_later(decode)  # never answered
    await claimed_and_aborted(decode)
    req = decode.req()
    decode.clock.advance(29.0)  # quarantine_max_s is 30
    await asyncio.sleep(5 * TICK_S)
    assert req.quarantined_at is not None
    decode.clock.advance(2.0)
    await until("release after quarantine_max_s", lambda: req.quarantined_at is None)
    assert decode.finished() == ([], ["r1"])


async def test_sender_whose_sidecar_is_gone_releases(decode: Decode) -> None:
    answer_later(decode)
    await claimed_and_aborted(decode)
    await asyncio.sleep(5 * TICK_S)
    assert decode.req().quarantined_at is not None
    decode.net.gone.add(P_ENDPOINT)
    await until("release", lambda: decode.req().quarantined_at is None)


async def test_prefill_abort_releases_without_asking(decode: Decode) -> None:
    answer_later(decode)
    decode.expect()
    decode.claim()
    # Prefill ended the send and drained before it said so.
    decode.side.aborted_by_prefill("r1", P_ENGINE, "engine aborted")
    req = decode.req()
    assert req.state is Status.ABORTED and req.quarantined_at is None
    assert decode.finished() == ([], ["r1"])


async def test_abort_from_a_prefill_that_did_not_claim_is_ignored(decode: Decode) -> None:
    decode.expect()
    decode.claim()
    decode.side.aborted_by_prefill("r1", "prefill-b", "forged")
    assert not decode.req().state.terminal


async def test_unclaimed_request_is_released_at_once(decode: Decode) -> None:
    decode.expect()
    assert await decode.side.abort(0, "r1", "client went away")
    assert decode.req().quarantined_at is None
    assert decode.finished() == ([], ["r1"])
    assert decode.net.sent(Abort) == []


async def test_lost_sender_keeps_the_quarantine_unless_it_said_it_stopped(
    decode: Decode,
) -> None:
    answer_later(decode)
    decode.expect("r1")
    decode.claim("r1")
    decode.expect("r2")
    decode.claim("r2")
    peer = decode.peers.by_engine(P_ENGINE)
    assert peer is not None
    decode.side.peer_lost(peer, "lease ran out")
    assert decode.req("r1").state is Status.FAILED
    assert decode.req("r1").quarantined_at is not None  # a SIGSTOPped prefill writes on waking
    decode.expect("r3")
    decode.claim("r3")
    decode.side.peer_lost(peer, "new generation", stopped=True)
    assert decode.req("r3").state is Status.FAILED and decode.req("r3").quarantined_at is None


async def test_sender_that_never_said_where_it_listens_releases(decode: Decode) -> None:
    decode.expect()
    decode.claim(engine="prefill-unmet")
    assert await decode.side.abort(0, "r1", "client went away")
    await until("release", lambda: decode.req().quarantined_at is None)


async def test_quarantined_request_keeps_its_sender_in_the_heartbeat(decode: Decode) -> None:
    answer_later(decode)
    await claimed_and_aborted(decode)
    assert decode.side.live_peers() == {P_ENDPOINT}
