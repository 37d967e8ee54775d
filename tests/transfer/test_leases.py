"""Leases: a peer silent for a whole lease is lost (its requests end at once) and is told so on
its next message; a write starts only to a peer heard from within half a lease, since the peer
may declare us lost a whole lease after it last heard from us."""

from __future__ import annotations

from app.transfer.wire.protocol import Hello, Pong, Role, Status
from tests.transfer.conftest import (
    D_ENDPOINT,
    D_ENGINE,
    LEASE_S,
    P_ENDPOINT,
    P_ENGINE,
    P_EPOCH,
    Decode,
    Prefill,
)


async def beat(decode: Decode, in_use: set[str] | None = None) -> None:
    await decode.peers.heartbeat({P_ENDPOINT} if in_use is None else in_use, D_ENGINE, "d-epoch-1")


async def test_peer_silent_between_half_and_a_whole_lease_is_not_written_to(
    prefill: Prefill,
) -> None:
    assert (await prefill.add()).ok
    prefill.clock.advance(0.4 * LEASE_S)
    assert prefill.pin("r1") == ["r1"]
    prefill.side.unpin(prefill.agent, ["r1"])
    prefill.clock.advance(0.2 * LEASE_S)  # 0.6 lease: decode has not declared us lost yet
    assert not prefill.peers.fresh(D_ENDPOINT)
    assert prefill.pin("r1") == []
    await prefill.tasks.settle()
    req = prefill.req()
    assert req.state is Status.FAILED and "not heard from recently" in req.error
    assert req.inflight == 0


async def test_answers_renew_the_lease(prefill: Prefill) -> None:
    assert (await prefill.add()).ok
    await prefill.peers.heartbeat({D_ENDPOINT}, P_ENGINE, P_EPOCH)  # in use from now
    prefill.clock.advance(0.4 * LEASE_S)
    await prefill.peers.heartbeat({D_ENDPOINT}, P_ENGINE, P_EPOCH)  # decode answers Pong
    prefill.clock.advance(0.4 * LEASE_S)
    assert prefill.pin("r1") == ["r1"]


async def test_in_use_peer_silent_past_the_lease_is_lost_and_told_so(decode: Decode) -> None:
    await beat(decode)
    decode.clock.advance(LEASE_S)
    await beat(decode)
    assert decode.peers.by_engine(P_ENGINE) is not None  # a whole lease, not more: kept
    decode.clock.advance(0.5)
    await beat(decode)
    assert decode.peers.by_engine(P_ENGINE) is None
    assert decode.peers.counters["leases_lost"] == 1
    assert [e for e, _ in decode.lost.calls] == [P_ENDPOINT]
    # It woke up and pings: it is told it was lost, so that it stops writing.
    assert decode.peers.heard(P_ENGINE, P_EPOCH) is False
    assert decode.peers.endpoint_of(P_ENGINE) == P_ENDPOINT  # decode can still ask it to drain


async def test_hello_forgives_a_lost_peer(decode: Decode) -> None:
    await beat(decode)
    decode.clock.advance(2 * LEASE_S)
    await beat(decode)
    assert not decode.peers.heard(P_ENGINE, P_EPOCH)
    decode.peers.met(
        Hello(
            compat_hash="", engine_id=P_ENGINE, role=Role.PREFILL, epoch=P_EPOCH, control=P_ENDPOINT
        )
    )
    assert decode.peers.heard(P_ENGINE, P_EPOCH)


async def test_restarted_peer_is_not_refused_for_its_old_epoch(decode: Decode) -> None:
    await beat(decode)
    decode.clock.advance(2 * LEASE_S)
    await beat(decode)
    assert decode.peers.heard(P_ENGINE, "p-epoch-2")


async def test_idle_peer_that_stops_answering_is_dropped_not_lost(decode: Decode) -> None:
    decode.clock.advance(2 * LEASE_S)
    await beat(decode, in_use=set())
    assert decode.peers.by_engine(P_ENGINE) is None
    assert decode.lost.calls == []
    assert decode.peers.heard(P_ENGINE, P_EPOCH)
    assert decode.net.links[0].closed


async def test_lease_starts_when_the_peer_comes_into_use(decode: Decode) -> None:
    decode.clock.advance(2 * LEASE_S)  # idle and silent for long
    await beat(decode)  # now in use: not lost at once
    assert decode.peers.by_engine(P_ENGINE) is not None


async def test_peer_that_declared_us_lost_is_lost(prefill: Prefill) -> None:
    assert (await prefill.add()).ok
    prefill.stub.ping = lambda _m: Pong(epoch="d-epoch-1", known=False)
    await prefill.peers.heartbeat({D_ENDPOINT}, P_ENGINE, P_EPOCH)
    assert D_ENDPOINT not in prefill.peers.table
    assert "declared this sidecar lost" in prefill.lost.calls[0][1]


async def test_peer_that_restarted_is_lost(prefill: Prefill) -> None:
    assert (await prefill.add()).ok
    prefill.stub.ping = lambda _m: Pong(epoch="d-epoch-2")
    await prefill.peers.heartbeat({D_ENDPOINT}, P_ENGINE, P_EPOCH)
    assert D_ENDPOINT not in prefill.peers.table
    assert "restarted" in prefill.lost.calls[0][1]


async def test_message_of_a_known_peer_renews_its_lease(decode: Decode) -> None:
    peer = decode.peers.by_engine(P_ENGINE)
    assert peer is not None
    decode.clock.advance(0.9 * LEASE_S)
    assert decode.peers.heard(P_ENGINE, P_EPOCH)
    assert peer.last_heard == decode.clock.now
    decode.clock.advance(1.0)
    decode.peers.heard(P_ENGINE, "another-epoch")  # not from the peer we know
    assert peer.last_heard == decode.clock.now - 1.0
