"""The router's spans, received by a real OTLP/gRPC receiver: the client's `traceparent`
(HTTP header, gRPC metadata) is the parent of the request span, admission and response
are its children; a malformed one starts a new trace; without `--otlp-traces-endpoint`
nothing is traced; the flag's errors.

The spans of the prefill and decode workers are checked end to end on a real cluster
(`tests/e2e/test_serve_cli.py::test_traces_follow_a_request_through_prefill_and_decode`).
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from protocol.tracing import NO_SPAN, Tracer, TracingConfig
from router.client import PdClusterClient
from tests.otlp_receiver import OtlpReceiver

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


def traceparent(trace_id: str = TRACE_ID, span_id: str = CLIENT_SPAN) -> str:
    return f"00-{trace_id}-{span_id}-01"


@pytest.fixture
def receiver():
    receiver = OtlpReceiver()
    yield receiver
    receiver.close()


def test_http_and_grpc_requests_are_children_of_the_client_span(make_servers, receiver):
    tracer = Tracer(TracingConfig(receiver.endpoint), "router")
    servers = make_servers(tracer=tracer)
    resp = httpx.post(f"http://127.0.0.1:{servers.http_port}/v1/completions", json={
        "model": "tiny", "prompt": "hello there", "max_tokens": 4, "ignore_eos": True},
        headers={"traceparent": traceparent(), "X-Request-Id": "traced-http"}, timeout=30)
    assert resp.status_code == 200
    grpc_trace = "1" * 32
    with PdClusterClient(f"127.0.0.1:{servers.grpc_port}", timeout=30) as client:
        outs = list(client.generate(prompt="hello there", max_tokens=3, ignore_eos=True,
                                    request_id="traced-grpc",
                                    traceparent=traceparent(grpc_trace)))
    assert outs[-1].finish_reason == "length"
    tracer.shutdown()  # exports what is buffered
    for trace_id, rid, tokens in ((TRACE_ID, "traced-http", 4), (grpc_trace, "traced-grpc", 3)):
        spans = {s.name: s for s in receiver.trace(trace_id, {"request", "admission",
                                                              "response"}, timeout_s=10)}
        assert len(spans) == 3
        request = spans["request"]
        assert request.parent_span_id == CLIENT_SPAN and request.kind == 2  # SERVER
        assert request.attributes["gen_ai.request.id"] == rid
        assert request.attributes["gen_ai.usage.completion_tokens"] == tokens
        assert request.attributes["gen_ai.response.finish_reasons"] == ("length",)
        assert request.attributes["pdcluster.workers"] == ("engine-0",)
        assert request.resource["service.name"] == "pdcluster-router"
        assert not request.error
        for child in ("admission", "response"):
            assert spans[child].parent_span_id == request.span_id


def test_a_malformed_traceparent_starts_a_new_trace(make_servers, receiver):
    tracer = Tracer(TracingConfig(receiver.endpoint), "router")
    servers = make_servers(tracer=tracer)
    resp = httpx.post(f"http://127.0.0.1:{servers.http_port}/v1/completions", json={
        "model": "tiny", "prompt": "hello", "max_tokens": 2},
        headers={"traceparent": "00-not-a-trace-01", "X-Request-Id": "bad-parent"}, timeout=30)
    assert resp.status_code == 200
    tracer.shutdown()
    (request,) = [s for s in receiver.spans if s.name == "request"]
    assert request.parent_span_id == "" and request.attributes["gen_ai.request.id"] == \
        "bad-parent"
    assert {s.trace_id for s in receiver.spans} == {request.trace_id}


def test_without_an_endpoint_nothing_is_traced():
    tracer = Tracer(None, "router")
    assert not tracer.enabled
    span = tracer.start("request", traceparent(), server=True, x=1)
    assert span is NO_SPAN and span.traceparent is None
    span.end("no error is recorded anywhere")


def test_the_flag_errors(monkeypatch):
    assert TracingConfig.from_flag(None) is None
    with pytest.raises(ValueError, match="must not be empty"):
        TracingConfig.from_flag(" ")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    with pytest.raises(ValueError, match="grpc only"):
        TracingConfig.from_flag("http://127.0.0.1:4318")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer x")
    config = TracingConfig.from_flag("http://127.0.0.1:4317")
    assert config.env["OTEL_EXPORTER_OTLP_HEADERS"] == "authorization=Bearer x"
    # The exporter package missing (an install without the `tracing` extra).
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
                        None)
    with pytest.raises(RuntimeError, match=r"pip install 'pdcluster\[tracing\]'"):
        TracingConfig.from_flag("http://127.0.0.1:4317")


@pytest.mark.subprocess
def test_tracing_off_imports_no_opentelemetry():
    code = ("import sys\n"
            "import cluster.dispatch, decode_worker.role, prefill_worker.role, router.router\n"
            "from protocol.tracing import Tracer\n"
            "Tracer(None, 'router').start('request', None).end()\n"
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]"
