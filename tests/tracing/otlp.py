"""A tiny OTLP/HTTP traces receiver: a real HTTP server in the test process that decodes what
the exporters post (protobuf) and keeps the spans in memory for the test to read."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.conftest import wait_for


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str  # hex, as in a traceparent
    span_id: str
    parent_id: str  # "" for a root span
    kind: int  # the OTLP enum: 2 server, 3 client, 1 internal
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    error: bool


def _value(v: Any) -> Any:
    field = v.WhichOneof("value")
    return getattr(v, field) if field else None


def decode_spans(body: bytes) -> list[ReceivedSpan]:
    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    out = []
    for rs in req.resource_spans:
        res = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    ReceivedSpan(
                        service=str(res.get("service.name", "")),
                        name=s.name,
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(),
                        kind=int(s.kind),
                        start_ns=int(s.start_time_unix_nano),
                        end_ns=int(s.end_time_unix_nano),
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        error=s.status.code == 2,  # STATUS_CODE_ERROR
                    )
                )
    return out


class OtlpReceiver:
    """``with OtlpReceiver() as r:`` serves ``r.endpoint`` (a traces URL) until the block ends."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.posts = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                spans = decode_spans(body)
                with receiver._lock:
                    receiver.spans.extend(spans)
                    receiver.posts += 1
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def received(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def wait(
        self, what: str, ok: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 20.0
    ) -> list[ReceivedSpan]:
        """The spans received, once ``ok`` holds for them."""

        def check() -> list[ReceivedSpan] | None:
            spans = self.received()
            return spans if ok(spans) else None

        return list(wait_for(what, check, timeout_s))


@pytest.fixture
def otlp() -> Iterator[OtlpReceiver]:
    """A receiver; ask for it before the processes that export to it, so that it outlives
    them (they export what is left when they stop)."""
    with OtlpReceiver() as receiver:
        yield receiver
