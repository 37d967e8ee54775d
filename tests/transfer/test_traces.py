"""What a transfer's span record says (pure logic; the exported spans are checked end to end in
tests/e2e/test_tracing.py): times, children in order, error status, who is traced."""

from __future__ import annotations

import numpy as np

from app.tracing.spans import SpanRecord
from app.transfer.requests.agent import RecvRequest, SendRequest
from app.transfer.requests.traces import TransferTraces, transfer_span
from app.transfer.wire.protocol import Status

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _send(state: Status, error: str = "") -> SendRequest:
    req = SendRequest("r", 1, 300, (np.arange(3),), 1e9, "tcp://d:1", created=10.0)
    req.traceparent = TP
    # Recorded as results come back (not in layer order across steps): sorted by start.
    for step, layer, start, end in [
        (1, 0, 10.30, 10.31),
        (0, 1, 10.12, 10.14),
        (0, 0, 10.10, 10.11),
    ]:
        req.timeline.signalled(step, layer, False, start - 0.01)
        req.timeline.written(step, layer, 0, start, end, 64)
    req.timeline.signalled(1, 1, True, 10.4)  # signalled, never written: no span
    req.bytes = 192
    req.finish(state, error)
    req.finished_at = 10.5
    return req


def test_a_send_spans_admission_to_its_end_with_a_child_per_write() -> None:
    rec = transfer_span(_send(Status.DONE), "prefill-1")
    assert (rec.name, rec.start, rec.end, rec.error) == ("kv.send", 10.0, 10.5, None)
    assert rec.attributes["kv.request"] == "r" and rec.attributes["kv.rank"] == 1
    assert rec.attributes["kv.engine"] == "prefill-1" and rec.attributes["kv.state"] == "DONE"
    steps_layers = [(c.attributes["kv.step"], c.attributes["kv.layer"]) for c in rec.children]
    assert steps_layers == [(0, 0), (0, 1), (1, 0)]
    assert [(c.start, c.end) for c in rec.children] == [
        (10.10, 10.11),
        (10.12, 10.14),
        (10.30, 10.31),
    ]
    assert {c.name for c in rec.children} == {"kv.layer_write"}


def test_a_transfer_that_did_not_end_done_is_an_error_span() -> None:
    rec = transfer_span(_send(Status.FAILED, "decode rank 0 refused Done"), "p")
    assert rec.error == "decode rank 0 refused Done"
    recv = RecvRequest("r", 0, 300, (np.arange(3),), 1e9, "", created=5.0)
    recv.finish(Status.EXPIRED)
    rec = transfer_span(recv, "d")
    assert (rec.name, rec.error, rec.children) == ("kv.recv", "EXPIRED", ())


class Recorder:
    def __init__(self) -> None:
        self.emitted: list[tuple[str, SpanRecord]] = []

    def emit(self, parent: object, record: SpanRecord) -> None:
        self.emitted.append((getattr(parent, "header", ""), record))


def test_only_requests_with_a_traceparent_are_emitted() -> None:
    rec = Recorder()
    traces = TransferTraces(rec, "p")  # type: ignore[arg-type]
    untraced = _send(Status.DONE)
    untraced.traceparent = None
    garbled = _send(Status.DONE)
    garbled.traceparent = "garbage"
    traces.ended([untraced, garbled, _send(Status.DONE)])
    assert [(tp, r.name) for tp, r in rec.emitted] == [(TP, "kv.send")]
