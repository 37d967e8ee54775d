"""Span export with OpenTelemetry, imported lazily: the ``tracing`` extra is optional.

Tracing is on in a process only when the OTel SDK and the OTLP/HTTP exporter are installed and
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set
(``OTEL_SERVICE_NAME`` names the service, ``OTEL_BSP_*`` tune batching, ``OTEL_SDK_DISABLED=true``
turns it off). Without it, ``start`` still hands out traceparents,
so the trace context is carried and recorded, and nothing is exported.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any, Literal

from app.tracing.spans import Attribute, SpanRecord, clock_offset_ns, wall_ns
from app.tracing.traceparent import TraceParent, new_trace

log = logging.getLogger(__name__)

Kind = Literal["server", "client", "internal"]
ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def endpoint(env: Mapping[str, str] | None = None) -> str | None:
    """The OTLP/HTTP traces URL the environment sets, or None (tracing off): the traces
    endpoint as given, else the general one with ``/v1/traces`` (the exporter's own rule)."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if url := env.get(ENDPOINT_VARS[0], "").strip():
        return url
    if base := env.get(ENDPOINT_VARS[1], "").strip():
        return f"{base.rstrip('/')}/v1/traces"
    return None


class Tracing:
    """One process's tracer provider with its OTLP/HTTP exporter (batched, in a thread)."""

    def __init__(self, provider: Any) -> None:
        self._provider = provider
        self._tracer = provider.get_tracer("kv-sidecar")

    def start(
        self,
        name: str,
        parent: TraceParent | None,
        *,
        kind: Kind = "internal",
        attributes: Mapping[str, Attribute] | None = None,
        start_ns: int | None = None,
    ) -> Span:
        """A live span under ``parent`` (a new trace when None)."""
        from opentelemetry import context
        from opentelemetry.trace import SpanKind

        ctx = context.Context() if parent is None else _parent_context(parent)
        span = self._tracer.start_span(
            name,
            context=ctx,
            kind=getattr(SpanKind, kind.upper()),
            attributes=dict(attributes or {}),
            start_time=start_ns,
        )
        sc = span.get_span_context()
        # Sampled out (the parent's flags, OTEL_TRACES_SAMPLER): a non-recording span with its
        # own id and the unsampled flag, passed on all the same.
        own = TraceParent(f"{sc.trace_id:032x}", f"{sc.span_id:016x}", int(sc.trace_flags))
        return Span(own, span)

    def emit(
        self,
        parent: TraceParent,
        record: SpanRecord,
        *,
        kind: Kind = "internal",
        offset_ns: int | None = None,
    ) -> None:
        """``record`` (and its children, recursively) as ended spans under ``parent``."""
        offset = clock_offset_ns() if offset_ns is None else offset_ns
        span = self.start(
            record.name,
            parent,
            kind=kind,
            attributes=record.attributes,
            start_ns=wall_ns(record.start, offset),
        )
        for child in record.children:
            self.emit(span.traceparent, child, offset_ns=offset)
        span.end(record.error, end_ns=wall_ns(record.end, offset))

    def shutdown(self) -> None:
        """Export what is buffered and stop the exporter's thread."""
        self._provider.shutdown()


class Span:
    """A span being timed; without OTel only its traceparent (``otel`` is None)."""

    def __init__(self, traceparent: TraceParent, otel: Any = None) -> None:
        self.traceparent = traceparent
        self._otel = otel

    @property
    def trace_id(self) -> str:
        return self.traceparent.trace_id

    def set(self, key: str, value: Attribute | None) -> None:
        if self._otel is not None and value is not None:
            self._otel.set_attribute(key, value)

    def end(self, error: str | None = None, *, end_ns: int | None = None) -> None:
        if self._otel is None:
            return
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            self._otel.set_status(Status(StatusCode.ERROR, error))
        self._otel.end(end_time=end_ns)


def start(
    tracing: Tracing | None,
    name: str,
    parent: TraceParent | None,
    *,
    kind: Kind = "internal",
    attributes: Mapping[str, Attribute] | None = None,
) -> Span:
    """``tracing.start``, or without tracing a span that only carries a new span id."""
    if tracing is None:
        return Span(parent.child() if parent is not None else new_trace())
    return tracing.start(name, parent, kind=kind, attributes=attributes)


def open_tracing(service: str, env: Mapping[str, str] | None = None) -> Tracing | None:
    """The process's ``Tracing`` when an OTLP endpoint is set and OTel is installed; else None
    (logged once when an endpoint is set but the ``tracing`` extra is missing)."""
    env = os.environ if env is None else env
    url = endpoint(env)
    if url is None:
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        log.warning(
            "an OTLP endpoint (%s) is set but OpenTelemetry is not installed (%s); install "
            "kv-sidecar[tracing] to export spans. Trace context is still carried.",
            url,
            e,
        )
        return None
    name = env.get("OTEL_SERVICE_NAME", "").strip() or service
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    log.info("tracing: exporting spans of %s to %s", name, url)
    return Tracing(provider)


def _parent_context(parent: TraceParent) -> Any:
    from opentelemetry import trace

    sc = trace.SpanContext(
        int(parent.trace_id, 16),
        int(parent.span_id, 16),
        is_remote=True,
        trace_flags=trace.TraceFlags(parent.flags),
    )
    return trace.set_span_in_context(trace.NonRecordingSpan(sc))
