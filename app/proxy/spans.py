"""The proxy's spans (README "Tracing"): the request's server span and its upstream calls."""

from __future__ import annotations

from fastapi.responses import Response

from app.proxy.records import TransferTracker
from app.tracing.otel import Span, Tracing, start

# Every answer names the trace it belongs to, for the operator's trace search.
TRACE_ID_HEADER = "x-kv-trace-id"


def refused(server: Span, answer: Response) -> Response:
    """An answer the proxy gives itself before any upstream call: its span ends with it."""
    server.set("http.response.status_code", answer.status_code)
    server.end(f"answered {answer.status_code}")
    answer.headers[TRACE_ID_HEADER] = server.trace_id
    return answer


def call_span(tracing: Tracing | None, t: TransferTracker, role: str, url: str, path: str) -> Span:
    """The client span of one call to an upstream (``role``), under the request's span."""
    return start(
        tracing,
        f"POST {path} {role}",
        t.trace,
        kind="client",
        attributes={"server.address": url, "kv.role": role, "kv.transfer_id": t.transfer_id},
    )
