"""Decode ends a request on the ``Done`` of the prefill that claimed it, and only on that one:
DONE once every sender of the manifest delivered its groups, FAILED on a failure or a missing
group; a repeated Done (a retry after a lost ack) is acknowledged again and counted once."""

from __future__ import annotations

from app.transfer.wire.protocol import Status
from tests.transfer.conftest import P_ENGINE, Decode


def test_done_of_the_claiming_sender_ends_the_request(decode: Decode) -> None:
    decode.expect()
    decode.claim()
    assert decode.done().ok
    assert decode.req().state is Status.DONE
    assert decode.finished() == (["r1"], [])
    assert all(g.done == 1 for g in decode.agent.groups.values())


def test_done_from_another_engine_with_the_claimed_rank_is_refused(decode: Decode) -> None:
    decode.expect()
    decode.claim(engine=P_ENGINE, rank=0)
    ack = decode.done(engine="prefill-b", rank=0)
    assert not ack.ok and "did not claim" in (ack.error or "")
    assert decode.req().state is Status.PENDING and decode.req().delivered == {}


def test_done_before_any_claim_is_refused(decode: Decode) -> None:
    decode.expect()
    ack = decode.done()
    assert not ack.ok and "did not claim" in (ack.error or "")
    assert not decode.req().state.terminal


def test_failure_of_a_prefill_that_never_claimed_ends_the_request(decode: Decode) -> None:
    # It refused the target before claiming: it wrote nothing and may say so.
    decode.expect(prefill=P_ENGINE)
    assert decode.done(status=Status.FAILED).ok
    assert decode.req().state is Status.FAILED
    assert decode.req().quarantined_at is None  # nobody claimed: nothing to wait for
    assert decode.finished() == ([], ["r1"])


def test_unclaimed_failure_from_another_prefill_is_refused(decode: Decode) -> None:
    decode.expect(prefill=P_ENGINE)
    assert not decode.done(engine="prefill-b", status=Status.FAILED).ok
    decode.expect("r2")
    decode.claim("r2")
    assert not decode.done("r2", engine="prefill-b", status=Status.FAILED).ok
    assert not decode.req().state.terminal and not decode.req("r2").state.terminal


def test_repeated_done_is_acknowledged_and_counted_once(decode: Decode) -> None:
    decode.expect()
    decode.claim()
    assert decode.done().ok
    assert decode.done().ok  # the first ack was lost
    assert decode.side.counters["duplicate_dones"] == 1
    assert all(g.done == 1 for g in decode.agent.groups.values())
    decode.finished()  # reported: a retry still finds it in the history
    assert decode.done().ok
    assert decode.side.counters["duplicate_dones"] == 2


def test_failed_done_fails_the_request(decode: Decode) -> None:
    decode.expect()
    decode.claim()
    assert decode.done(status=Status.FAILED).ok
    req = decode.req()
    assert req.state is Status.FAILED and "prefill rank 0: FAILED" in req.error
    # That sender said it drained: no quarantine.
    assert req.quarantined_at is None
    assert decode.finished() == ([], ["r1"])


def test_done_missing_a_group_fails_the_request(decode: Decode) -> None:
    decode.expect()
    decode.claim()
    assert decode.done(groups=[]).ok
    assert decode.req().state is Status.FAILED
    assert "expected" in decode.req().error


def test_done_after_the_request_ended_is_refused(decode: Decode) -> None:
    decode.expect()
    decode.claim()
    decode.side.end(decode.req(), Status.EXPIRED, "deadline")
    ack = decode.done()
    assert not ack.ok and "already EXPIRED" in (ack.error or "")


def test_done_for_a_stale_epoch_or_unknown_request_is_refused(decode: Decode) -> None:
    decode.expect()
    decode.claim()
    assert not decode.done(epoch="old").ok
    assert not decode.done("unknown").ok
    assert not decode.req().state.terminal


def test_finished_requests_carry_their_totals(decode: Decode) -> None:
    """What the engine's stats read (``Finished.totals``): one entry per request reported, with
    the bytes and the side ``/v1/requests`` shows."""
    decode.expect()
    decode.claim()
    decode.expect("r2", prefill=P_ENGINE)
    assert decode.done().ok
    assert decode.done("r2", status=Status.FAILED).ok
    sending, recving, failed = decode.agent.finished()
    totals = decode.agent.totals(sending, recving, failed)
    assert [(t.request, t.side, t.status, t.bytes) for t in totals] == [
        ("r1", "recv", Status.DONE, 100),
        ("r2", "recv", Status.FAILED, 100),  # what its sender wrote before it failed
    ]
    assert all(t.duration_s >= 0 for t in totals)
