"""OpenTelemetry is optional: which environment turns export on, and without the package the
proxy and the sidecar import and run, carrying trace context with nothing exported."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from app.tracing.otel import endpoint, open_tracing, start
from app.tracing.traceparent import new_trace


@pytest.mark.parametrize(
    ("env", "url"),
    [
        ({}, None),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/x"}, "http://c:4318/x"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}, "http://c:4318/v1/traces"),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://a",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://b",
            },
            "http://b",
        ),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a", "OTEL_SDK_DISABLED": "true"}, None),
    ],
)
def test_export_is_on_only_with_an_endpoint(env: dict[str, str], url: str | None) -> None:
    assert endpoint(env) == url
    if url is None:
        assert open_tracing("svc", env) is None


def test_without_tracing_spans_still_hand_out_context() -> None:
    parent = new_trace()
    span = start(None, "x", parent)
    assert span.traceparent.trace_id == parent.trace_id != ""
    assert span.traceparent.span_id != parent.span_id
    span.end("nothing happens")  # no exporter: a no-op
    assert start(None, "y", None).trace_id != parent.trace_id  # no parent: a new trace


BLOCKED = textwrap.dedent(
    """
    import importlib.abc, logging, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] == "opentelemetry":
                raise ImportError(f"blocked: {name}")

    sys.meta_path.insert(0, Block())
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    import app.proxy.app, app.transfer.sidecar.process  # noqa: E401
    from app.tracing.otel import open_tracing, start
    from app.tracing.traceparent import new_trace

    assert open_tracing("svc", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}) is None
    parent = new_trace()
    assert start(None, "x", parent).traceparent.trace_id == parent.trace_id
    assert not [m for m in sys.modules if m.startswith("opentelemetry")]
    print("ok")
    """
)


def test_without_the_package_everything_imports_and_tracing_stays_off() -> None:
    out = subprocess.run(
        [sys.executable, "-c", BLOCKED], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    assert "OpenTelemetry is not installed" in out.stderr
