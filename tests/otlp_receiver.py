"""A real OTLP/gRPC trace receiver in the test process: opentelemetry-proto's
`TraceService`, on a loopback port, keeping every span it is sent with its resource."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as it arrived: ids in hex, its attributes and its resource's, flattened."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    error: bool


def _value(any_value: Any) -> Any:
    field = any_value.WhichOneof("value")
    if field == "array_value":
        return tuple(_value(v) for v in any_value.array_value.values)
    return getattr(any_value, field) if field else None


def _flat(key_values: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in key_values}


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Serves `opentelemetry.proto.collector.trace.v1.TraceService/Export` on 127.0.0.1."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server.start()

    def Export(self, request: Any, context: Any) -> Any:
        received = []
        for resource_spans in request.resource_spans:
            resource = _flat(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(ReceivedSpan(
                        span.name, span.trace_id.hex(), span.span_id.hex(),
                        span.parent_span_id.hex(), span.kind, _flat(span.attributes), resource,
                        span.status.code == span.status.STATUS_CODE_ERROR))
        with self._lock:
            self.spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()

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

    def close(self) -> None:
        self._server.stop(grace=None)
