"""Issue 12's CPU done-when: a layer is written only after its event completed.

Real sidecars and Mooncake over loopback TCP (``harness``); the prefill engine's side (its
event ring, its KV) runs in this process with events that complete when the test says. While
an event is pending, decode's KV for that layer stays as it was and the prefill sidecar has
sent no byte of it; once it completes the layer lands, byte-exact.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from app.sim.fill import request_salt
from app.sim.kv_io import check_tokens, verify_request, write_tokens
from app.transfer.wire.protocol import StepSlice
from tests.devices.harness import PAGE, LateEvent, Pair

pytestmark = pytest.mark.timeout(240)

HOLD_S = 1.0  # how long the test keeps an event pending (the send deadline is 4 s)
PROMPT = 64  # four 16-token blocks


def _buffer(pair: Pair, layer: int) -> torch.Tensor:
    d = pair.d_layout
    assert d is not None
    return d.buffers[d.placements[layer].buffer]


def test_each_layer_is_written_only_after_its_event_completed(pair: Pair) -> None:
    rid = "gate-1"
    p_ids = [np.arange(1, 5, dtype=np.int64)]
    d_ids = [np.arange(9, 13, dtype=np.int64)]
    salt = request_salt(rid)
    p, d = pair.p_layout, pair.d_layout
    assert p is not None and d is not None
    layers = sorted(p.placements)
    for layer in layers:
        write_tokens(p, layer, p_ids[0], 0, PROMPT, salt)
    before = {layer: _buffer(pair, layer).clone() for layer in layers}
    sent_before = pair.poll(pair.p).bytes

    pair.d.expect_receive(rid, PROMPT, d_ids, prefill_tp=1)
    pair.send(rid, PROMPT, p_ids, d_ids)
    pair.p.begin_step(1, [StepSlice(rid, 0, PROMPT)])
    events = {layer: LateEvent() for layer in layers}
    t0 = time.monotonic()
    for layer in layers:
        pair.p.layer_ready(1, layer, events[layer])
    assert time.monotonic() - t0 < 0.5, "layer_ready waited on its event"

    # Every event pending: nothing may move.
    time.sleep(HOLD_S)
    for layer in layers:
        assert torch.equal(_buffer(pair, layer), before[layer]), f"layer {layer} written early"
    assert pair.poll(pair.p).bytes == sent_before
    assert rid not in pair.seen

    # Layer 0 completes: it lands (whole), layer 1 still does not move.
    events[0].complete()
    tokens = np.arange(PROMPT)
    deadline = time.monotonic() + 20
    while check_tokens(d, 0, d_ids[0], tokens, salt):
        assert time.monotonic() < deadline, "layer 0 did not land after its event completed"
        time.sleep(0.02)
    time.sleep(0.3)
    assert torch.equal(_buffer(pair, 1), before[1]), "layer 1 written before its event"
    assert pair.poll(pair.p).bytes - sent_before == len(p_ids[0]) * PAGE

    events[1].complete()
    assert pair.wait_end(pair.d, rid, 20) == "DONE"
    assert pair.wait_end(pair.p, rid, 20) == "DONE"
    assert verify_request(d, d_ids, PROMPT, salt=salt) == []
    assert pair.poll(pair.p).bytes - sent_before == len(layers) * len(p_ids[0]) * PAGE
