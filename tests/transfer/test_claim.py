"""Decode lets a prefill rank write a request only after it claimed it, and only into the
request's own blocks, for the epoch decode runs, from the prefill the request names."""

from __future__ import annotations

from tests.transfer.conftest import MINE, OTHER, P_ENGINE, Decode


def test_claim_of_the_requests_own_blocks_names_the_writer(decode: Decode) -> None:
    decode.expect()
    ack = decode.claim()
    assert ack.ok, ack.error
    assert decode.req().senders == {0: P_ENGINE}


def test_claim_of_another_requests_blocks_is_refused(decode: Decode) -> None:
    decode.expect("r1", MINE)
    decode.expect("r2", OTHER)
    ack = decode.claim("r1", block_ids=OTHER)
    assert not ack.ok and "are not request r1's" in (ack.error or "")
    assert decode.req("r1").senders == {}
    assert decode.side.counters["refused_claims"] == 1


def test_claim_for_a_stale_epoch_is_refused(decode: Decode) -> None:
    decode.expect()
    ack = decode.claim(epoch="an-old-epoch")
    assert not ack.ok and "stale epoch" in (ack.error or "")


def test_claim_of_an_unknown_or_ended_request_is_refused(decode: Decode) -> None:
    assert not decode.claim("nobody-expects-this").ok
    decode.expect()
    decode.req().finish(decode.req().state.FAILED, "ended")
    ack = decode.claim()
    assert not ack.ok and "not expected" in (ack.error or "")


def test_claim_from_a_rank_outside_the_manifest_is_refused(decode: Decode) -> None:
    decode.expect()  # prefill TP 1: only rank 0 delivers
    ack = decode.claim(rank=1)
    assert not ack.ok and "not in the manifest" in (ack.error or "")


def test_claim_from_another_prefill_than_the_request_names_is_refused(decode: Decode) -> None:
    decode.expect(prefill=P_ENGINE)
    ack = decode.claim(engine="prefill-b")
    assert not ack.ok and f"expects prefill {P_ENGINE}" in (ack.error or "")


def test_second_prefill_cannot_claim_a_claimed_request(decode: Decode) -> None:
    decode.expect()  # names no prefill: the first claim wins
    assert decode.claim().ok
    ack = decode.claim(engine="prefill-b")
    assert not ack.ok and f"already claimed by prefill {P_ENGINE}" in (ack.error or "")
    assert decode.req().senders == {0: P_ENGINE}
