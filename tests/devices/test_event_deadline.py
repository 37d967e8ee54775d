"""An event that never completes fails its request with a sentence naming the event, before
the request's deadline, and nothing is written for that layer (real P/D pair, ``harness``)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from app.sim.fill import request_salt
from app.sim.kv_io import write_tokens
from app.transfer.wire.protocol import FailedRequest, Status, StepSlice
from tests.devices.harness import SEND_TIMEOUT_S, LateEvent, Pair

pytestmark = pytest.mark.timeout(240)

PROMPT = 64


def test_a_stuck_event_fails_the_request_within_the_deadline(pair: Pair) -> None:
    rid = "stuck-1"
    p_ids = [np.arange(5, 9, dtype=np.int64)]
    d_ids = [np.arange(13, 17, dtype=np.int64)]
    p, d = pair.p_layout, pair.d_layout
    assert p is not None and d is not None
    for layer in sorted(p.placements):
        write_tokens(p, layer, p_ids[0], 0, PROMPT, request_salt(rid))
    layer0 = d.buffers[d.placements[0].buffer]
    before = layer0.clone()

    stuck, fine = LateEvent(), LateEvent()
    fine.complete()
    t0 = time.monotonic()
    pair.d.expect_receive(rid, PROMPT, d_ids, prefill_tp=1)
    pair.send(rid, PROMPT, p_ids, d_ids)
    pair.p.begin_step(2, [StepSlice(rid, 0, PROMPT)])
    try:
        pair.p.layer_ready(2, 0, stuck)
        pair.p.layer_ready(2, 1, fine)
        end = pair.wait_end(pair.p, rid, SEND_TIMEOUT_S + 10)
        elapsed = time.monotonic() - t0
        assert isinstance(end, FailedRequest), end
        assert end.status is Status.FAILED, (end.status, end.error)
        assert "layer 0's event (ring slot" in end.error
        assert "did not complete within" in end.error
        assert elapsed < SEND_TIMEOUT_S, f"ended after {elapsed:.2f}s"
        got = pair.wait_end(pair.d, rid, 15)
        assert isinstance(got, FailedRequest) and got.status is Status.FAILED, got
        assert torch.equal(layer0, before), "layer 0 was written without its event"
    finally:
        stuck.complete()  # lets the engine's waiter thread go on to later events
