"""A transfer's spans, emitted once its rank reported it ended (README "Tracing").

Decode: one ``kv.recv`` span, expect → final state. Prefill: one ``kv.send`` span, admission
→ final state, with a ``kv.layer_write`` child per layer write (submit → landed, per step of
a chunked prefill). Each is a child of the traceparent the engine passed with the request;
a request without one is not traced.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from app.tracing.otel import Tracing
from app.tracing.spans import SpanRecord
from app.tracing.traceparent import parse
from app.transfer.requests.agent import Request, SendRequest
from app.transfer.wire.protocol import Status

log = logging.getLogger(__name__)


def transfer_span(req: Request, engine_id: str) -> SpanRecord:
    """``req``'s span record (with its layer writes, on the send side)."""
    send = isinstance(req, SendRequest)
    attributes: dict[str, str | int | float | bool] = {
        "kv.request": req.id,
        "kv.engine": engine_id,
        "kv.rank": req.rank,
        "kv.state": req.state.name,
        "kv.prompt_len": req.prompt_len,
        "kv.bytes": req.bytes,
    }
    if req.peer:
        attributes["kv.peer"] = req.peer
    layers = req.timeline.layers.values() if isinstance(req, SendRequest) else ()
    children = tuple(
        SpanRecord(
            "kv.layer_write",
            w.submitted,
            w.landed,
            {
                "kv.layer": w.layer,
                "kv.step": w.step,
                "kv.group": w.group if w.group is not None else -1,
                "kv.bytes": w.bytes,
            },
        )
        for w in sorted(layers, key=lambda w: (w.submitted or 0.0, w.layer))
        if w.submitted is not None and w.landed is not None  # signalled, never written
    )
    return SpanRecord(
        "kv.send" if send else "kv.recv",
        req.created,
        req.finished_at if req.finished_at is not None else req.created,
        attributes,
        children,
        error=None if req.state is Status.DONE else (req.error or req.state.name),
    )


class TransferTraces:
    """Emits the spans of the requests a rank reported ended, when tracing is on."""

    def __init__(self, tracing: Tracing | None, engine_id: str) -> None:
        self.tracing, self._engine_id = tracing, engine_id

    def ended(self, reqs: Iterable[Request]) -> None:
        if self.tracing is None:
            return
        for req in reqs:
            parent = parse(req.traceparent)
            if parent is None:
                continue
            try:
                self.tracing.emit(parent, transfer_span(req, self._engine_id))
            except Exception:  # a tracing fault must never reach the transfer path
                log.exception("request %s: its spans were not emitted", req.id)

    def close(self) -> None:
        if self.tracing is not None:
            self.tracing.shutdown()
