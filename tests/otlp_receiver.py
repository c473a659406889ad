"""Real OTLP trace receivers in the test process, on loopback ports, keeping every span they
are sent with its resource: `OtlpReceiver` serves OTLP/gRPC (opentelemetry-proto's
`TraceService`), `OtlpHttpReceiver` OTLP/HTTP (`POST /v1/traces`, an `http/protobuf`
`ExportTraceServiceRequest`)."""

from __future__ import annotations

import gzip
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as it arrived: ids in hex, its attributes and its resource's, flattened;
    `trace_state` the W3C `tracestate` of its context."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    error: bool
    trace_state: str = ""


def _value(any_value: Any) -> Any:
    field = any_value.WhichOneof("value")
    if field == "array_value":
        return tuple(_value(v) for v in any_value.array_value.values)
    return getattr(any_value, field) if field else None


def _flat(key_values: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in key_values}


def _received(request: Any) -> list[ReceivedSpan]:
    received = []
    for resource_spans in request.resource_spans:
        resource = _flat(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                received.append(ReceivedSpan(
                    span.name, span.trace_id.hex(), span.span_id.hex(),
                    span.parent_span_id.hex(), span.kind, _flat(span.attributes), resource,
                    span.status.code == span.status.STATUS_CODE_ERROR, span.trace_state))
    return received


class _Spans:
    """The spans received so far, and waiting for a trace's."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()

    def _add(self, request: Any) -> None:
        received = _received(request)
        with self._lock:
            self.spans.extend(received)

    def trace(self, trace_id: str, names: set[str], timeout_s: float = 60.0
              ) -> list[ReceivedSpan]:
        """The spans of one trace, once spans of every name in `names` have arrived."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                spans = [s for s in self.spans if s.trace_id == trace_id]
            if names <= {s.name for s in spans}:
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"trace {trace_id}: got {sorted(s.name for s in spans)}, "
                                     f"waiting for {sorted(names)}")
            time.sleep(0.05)


class OtlpReceiver(_Spans, trace_service_pb2_grpc.TraceServiceServicer):
    """Serves `opentelemetry.proto.collector.trace.v1.TraceService/Export` on 127.0.0.1."""

    def __init__(self) -> None:
        super().__init__()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server.start()

    def Export(self, request: Any, context: Any) -> Any:
        self._add(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def close(self) -> None:
        self._server.stop(grace=None)


class OtlpHttpReceiver(_Spans):
    """Serves OTLP/HTTP `POST /v1/traces` (`application/x-protobuf`, gzip or not) on
    127.0.0.1; `endpoint` is its URL with the path, `requests` the POSTs' paths and content
    types."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[tuple[str, str]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.requests.append((self.path, self.headers.get("Content-Type", "")))
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._add(request)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.endpoint = f"{self.base_url}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
