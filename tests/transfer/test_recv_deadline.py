"""Decode's receive deadline has two parts: the wait for a prefill to claim the request (it
may sit in prefill's queue that long) and, from the claim on, the writes' own idle bound (how
it follows prefill's progress: test_progress_deadlines.py). A bound
counted from decode's admission would end a queued request EXPIRED while prefill still holds
it, and both engines would then compute the prompt (what ``bench load`` showed past the knee)."""

from __future__ import annotations

import pytest

from app.transfer.requests.receiving import expiry_reason
from app.transfer.wire.protocol import Status
from tests.transfer.conftest import P_ENGINE, Decode


def test_the_wait_for_a_claim_has_the_queue_bound(decode: Decode) -> None:
    start = decode.clock()
    decode.expect(timeout_s=5, queue_timeout_s=60)
    assert decode.req().deadline == pytest.approx(start + 60)


def test_a_claim_restarts_the_deadline_at_the_writes_bound(decode: Decode) -> None:
    decode.expect(timeout_s=5, queue_timeout_s=60)
    decode.clock.advance(40)  # queued at prefill, far past the writes' 5 s
    assert decode.claim().ok
    assert decode.req().deadline == pytest.approx(decode.clock() + 5)
    assert decode.done().ok
    assert decode.req().state is Status.DONE


def test_a_claim_shortens_a_long_queue_bound(decode: Decode) -> None:
    """A prefill that claimed and then stalls is found out by the writes' bound, not the
    queue's."""
    decode.expect(timeout_s=5, queue_timeout_s=600)
    decode.clock.advance(1)
    decode.claim()
    assert decode.req().deadline == pytest.approx(decode.clock() + 5)


def test_without_a_queue_bound_the_wait_is_the_writes_bound(decode: Decode) -> None:
    start = decode.clock()
    decode.expect(timeout_s=5)
    assert decode.req().deadline == pytest.approx(start + 5)
    decode.clock.advance(3)
    decode.claim()
    assert decode.req().deadline == pytest.approx(start + 8)


def test_a_second_claim_is_progress_but_the_cap_counts_from_the_first(decode: Decode) -> None:
    decode.expect(timeout_s=5, queue_timeout_s=60)
    decode.claim()
    claimed_at, cap = decode.clock(), decode.req().cap
    decode.clock.advance(2)
    decode.claim()  # the same rank again (a retried claim): prefill is alive and at work
    assert decode.req().deadline == pytest.approx(decode.clock() + 5)
    assert decode.req().claimed_at == claimed_at and decode.req().cap == cap


def test_the_expiry_names_the_bound_that_passed(decode: Decode) -> None:
    decode.expect("queued", timeout_s=5, queue_timeout_s=60)
    decode.expect("stalled", timeout_s=5, queue_timeout_s=60)
    decode.claim("stalled")
    queued = expiry_reason(decode.req("queued"))
    assert "no prefill claimed it within 60 s" in queued and "recv_queue_timeout_s" in queued
    stalled = expiry_reason(decode.req("stalled"))
    assert f"prefill {P_ENGINE} claimed it" in stalled and "for 5 s (recv_timeout_s)" in stalled
