"""W3C trace context through the proxy, the connector and the sidecars (README "Tracing").

``traceparent`` is pure code and always on: the header is parsed, carried and recorded whether
or not OpenTelemetry is installed. ``otel`` and ``spans`` export spans over OTLP/HTTP only when
the optional ``tracing`` extra is installed and an OTLP endpoint is set.
"""
