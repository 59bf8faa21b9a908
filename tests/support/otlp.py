"""An in-process OTLP/HTTP trace receiver: services export to it, tests read the spans."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


@dataclass
class SpanRecord:
    name: str
    service: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any] = field(default_factory=dict)


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[SpanRecord] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                receiver._add(req)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def _add(self, req: ExportTraceServiceRequest) -> None:
        with self._lock:
            for rs in req.resource_spans:
                service = next(
                    (
                        a.value.string_value
                        for a in rs.resource.attributes
                        if a.key == "service.name"
                    ),
                    "",
                )
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        attrs = {
                            a.key: a.value.string_value or a.value.int_value for a in s.attributes
                        }
                        self.spans.append(
                            SpanRecord(
                                s.name,
                                service,
                                s.trace_id.hex(),
                                s.span_id.hex(),
                                s.parent_span_id.hex(),
                                attrs,
                            )
                        )

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
