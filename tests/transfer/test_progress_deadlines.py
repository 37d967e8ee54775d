"""Deadlines follow progress, not the clock (issue 55, item 0): a transfer whose prefill still
computes and writes chunk after chunk never expires, however long it takes; one whose progress
stops expires after its idle bound (``send_timeout_s``, ``recv_timeout_s``); every one at the
absolute cap (``transfer_max_s``). Fixed deadlines counted from the claim threw a 60 s prefill
away at 30 s, and both engines computed the prompt.

Prefill's progress: a chunk scheduled (``BeginStep``), a layer signalled (``LayerReady``) or
written. Decode's: a claim, a ``Done``, a prefill heartbeat naming the request as still sent.
Unit tests of both state machines with a settable clock; the real-engine test is
tests/connectors/vllm/test_slow_prefill.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from app.kvcache.desc import LayoutDesc
from app.transfer.requests.receiving import RecvSettings, RecvSide
from app.transfer.requests.send_ending import SendSettings
from app.transfer.requests.stream import LayerResult
from app.transfer.wire.protocol import Done, Hello, Msg, Ping, Reply, Role, Status
from tests.transfer.conftest import (
    D_ENDPOINT,
    D_ENGINE,
    P_ENDPOINT,
    P_ENGINE,
    P_EPOCH,
    TICK_S,
    Decode,
    Prefill,
    Stream,
    make_prefill,
    step,
)

IDLE_S = 5.0  # both sides' idle bound
CHUNK_S = 4.0  # one chunk's forward: shorter than the idle bound
CHUNKS = 10  # 40 s of prefill, 8 idle bounds: far past a deadline counted from the start
TOKENS = 4  # per chunk; the fixtures' prompt is 40 tokens


# ---- prefill -----------------------------------------------------------------------------------


async def make_slow_prefill(layout: LayoutDesc, transfer_max_s: float = 3600.0) -> Prefill:
    settings = SendSettings(
        engine_id=P_ENGINE, send_timeout_s=IDLE_S, ack_timeout_s=1.0, transfer_max_s=transfer_max_s
    )
    p = make_prefill(layout, settings=settings)
    p.agent.stream = Stream()  # type: ignore[assignment]
    return p


@pytest.fixture
async def slow(layout: LayoutDesc) -> AsyncIterator[Prefill]:
    p = await make_slow_prefill(layout)
    yield p
    await p.tasks.cancel()


def admitted(reply: Msg) -> None:
    assert isinstance(reply, Reply) and reply.ok, reply


def written(p: Prefill, n: int, rid: str = "r1") -> None:
    """Step ``n``'s layers landed at decode (what the stream thread reports)."""
    for pl in p.agent.desc.placements:
        p.side.layer_done(
            p.agent,
            LayerResult(n, pl.layer, pl.group, [rid], {}, {(rid, 0): 64}, 64, 1, 1, 0.001),
        )


async def test_a_send_that_keeps_progressing_outlives_the_idle_bound(slow: Prefill) -> None:
    admitted(await slow.add())
    start = slow.clock()
    for n in range(CHUNKS):
        slow.clock.advance(CHUNK_S)
        await step(slow, n, n * TOKENS, (n + 1) * TOKENS)
        assert slow.req().deadline == pytest.approx(slow.clock() + IDLE_S)
        assert slow.side.expire(slow.clock()) == 0
        slow.clock.advance(CHUNK_S / 2)
        written(slow, n)  # the chunk's writes land: progress too
        assert slow.side.expire(slow.clock()) == 0
    assert slow.clock() - start >= 8 * IDLE_S
    await slow.tasks.settle()
    assert slow.req().state is Status.DONE, slow.req().error
    [done] = slow.net.sent(Done, D_ENDPOINT)
    assert done.status is Status.DONE


async def test_a_send_whose_progress_stops_expires_after_the_idle_bound(slow: Prefill) -> None:
    admitted(await slow.add())
    slow.clock.advance(CHUNK_S)
    await step(slow, 0, 0, TOKENS)
    slow.clock.advance(IDLE_S - 0.01)
    assert slow.side.expire(slow.clock()) == 0
    slow.clock.advance(0.02)  # the engine stalled: no chunk, no layer, no write
    assert slow.side.expire(slow.clock()) == 1
    req = slow.req()
    assert req.state is Status.EXPIRED
    assert "no progress for 5 s (send_timeout_s)" in req.error
    await slow.tasks.settle()
    [done] = slow.net.sent(Done, D_ENDPOINT)  # decode hears it now, not at its own bound
    assert done.status is Status.EXPIRED


async def test_a_progressing_send_ends_at_the_absolute_cap(layout: LayoutDesc) -> None:
    p = await make_slow_prefill(layout, transfer_max_s=3 * CHUNK_S + 1)
    try:
        admitted(await p.add())
        for n in range(3):
            p.clock.advance(CHUNK_S)
            await step(p, n, n * TOKENS, (n + 1) * TOKENS)
            assert p.side.expire(p.clock()) == 0
        p.clock.advance(1.5)  # 1.5 s after the last progress, past the cap
        assert p.side.expire(p.clock()) == 1
        assert p.req().state is Status.EXPIRED
        assert "(transfer_max_s)" in p.req().error
    finally:
        await p.tasks.cancel()


async def test_progress_does_not_extend_the_wait_for_decodes_target(slow: Prefill) -> None:
    """A held send waits on decode, not on its engine: its layers do not keep it."""
    admitted(await slow.add(waiting=True))
    for n in range(2):
        slow.clock.advance(IDLE_S / 2 - 0.1)
        await step(slow, n, n * TOKENS, (n + 1) * TOKENS)
    slow.clock.advance(0.3)
    assert slow.side.expire(slow.clock()) == 1
    assert "decode's target did not come" in slow.req().error


async def test_heartbeats_name_the_sends_still_in_flight(slow: Prefill) -> None:
    admitted(await slow.add("live"))
    admitted(await slow.add("held", waiting=True))  # not claimed at decode: not named
    admitted(await slow.add("ended"))
    slow.side.fail(slow.req("ended"), "a write failed")
    assert slow.side.sending_to(D_ENDPOINT) == ["live"]
    assert slow.side.sending_to("tcp://other.test:1") == []
    await slow.peers.heartbeat([D_ENDPOINT], P_ENGINE, P_EPOCH, slow.side.sending_to)
    [ping] = slow.net.sent(Ping, D_ENDPOINT)
    assert ping.sending == ["live"]


# ---- decode ------------------------------------------------------------------------------------


def heartbeat(decode: Decode, engine: str = P_ENGINE, rid: str = "r1") -> None:
    decode.side.still_sending(engine, [rid])


def test_a_receive_that_hears_prefill_sending_outlives_the_idle_bound(decode: Decode) -> None:
    decode.expect(timeout_s=IDLE_S, queue_timeout_s=60)
    assert decode.claim().ok
    claimed = decode.clock()
    for _ in range(CHUNKS):
        decode.clock.advance(CHUNK_S)
        heartbeat(decode)
        assert decode.side.expire(decode.clock()) == 0
    assert decode.clock() - claimed >= 8 * IDLE_S
    assert decode.done().ok
    assert decode.req().state is Status.DONE


def test_a_receive_whose_prefill_falls_silent_expires_after_the_idle_bound(
    decode: Decode,
) -> None:
    decode.expect(timeout_s=IDLE_S, queue_timeout_s=60)
    assert decode.claim().ok
    decode.clock.advance(CHUNK_S)
    heartbeat(decode)
    decode.clock.advance(IDLE_S - 0.01)
    assert decode.side.expire(decode.clock()) == 0
    decode.clock.advance(0.02)
    assert decode.side.expire(decode.clock()) == 1
    req = decode.req()
    assert req.state is Status.EXPIRED
    assert f"prefill {P_ENGINE} claimed it" in req.error
    assert "for 5 s (recv_timeout_s)" in req.error


def test_only_the_claiming_prefill_keeps_a_receive(decode: Decode) -> None:
    """Another prefill's heartbeat naming the request is not this transfer's progress, and no
    heartbeat extends the wait for a claim (the queue bound)."""
    decode.expect("queued", timeout_s=IDLE_S, queue_timeout_s=60)
    queued = decode.req("queued").deadline
    decode.expect(timeout_s=IDLE_S, queue_timeout_s=60)
    assert decode.claim().ok
    stranger = "prefill-b"
    decode.peers.met(
        Hello(compat_hash="", engine_id=stranger, role=Role.PREFILL, control=P_ENDPOINT + "9")
    )
    for _ in range(3):
        decode.clock.advance(2.0)
        heartbeat(decode, stranger)
        heartbeat(decode, P_ENGINE, "queued")
    assert decode.req("queued").deadline == queued
    assert decode.side.expire(decode.clock()) == 1
    assert decode.req().state is Status.EXPIRED
    assert not decode.req("queued").state.terminal


async def test_a_receive_ends_at_the_absolute_cap(decode: Decode) -> None:
    side = RecvSide(
        RecvSettings(
            engine_id=D_ENGINE,
            recv_timeout_s=60.0,
            recv_queue_timeout_s=None,
            quarantine_max_s=30.0,
            heartbeat_interval_s=TICK_S,
            transfer_max_s=3 * CHUNK_S + 1,
        ),
        {0: decode.agent},
        decode.peers,
        spawn=decode.tasks.spawn,
        epoch=lambda: decode.epoch[0],
        clock=decode.clock,
    )
    decode.side = side
    decode.expect(timeout_s=IDLE_S, queue_timeout_s=60)
    decode.clock.advance(30)  # queued at prefill: the cap counts from the claim
    assert decode.claim().ok
    for _ in range(3):
        decode.clock.advance(CHUNK_S)
        heartbeat(decode)
        assert side.expire(decode.clock()) == 0
    decode.clock.advance(1.5)
    assert side.expire(decode.clock()) == 1
    req = decode.req()
    assert req.state is Status.EXPIRED and "(transfer_max_s)" in req.error
