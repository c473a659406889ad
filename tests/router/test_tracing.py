"""The router's spans, received by a real OTLP/gRPC receiver: the client's `traceparent`
(HTTP header, gRPC metadata) is the parent of the request span, admission and response
are its children; a malformed one starts a new trace; without `--otlp-traces-endpoint`
nothing is traced; the flag's errors. The same spans over OTLP/HTTP (`http/protobuf`) to a
real OTLP/HTTP receiver, picked by the endpoint's `/v1/traces` path or by
`OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL`; a W3C `tracestate` kept in the spans' context.

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
from tests.otlp_receiver import OtlpHttpReceiver, OtlpReceiver

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
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="grpc or http/protobuf"):
        TracingConfig.from_flag("http://127.0.0.1:4318")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    with pytest.raises(ValueError, match="needs an http:// or https:// URL"):
        TracingConfig.from_flag("127.0.0.1:4318")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer x")
    config = TracingConfig.from_flag("http://127.0.0.1:4317")
    assert config.env["OTEL_EXPORTER_OTLP_HEADERS"] == "authorization=Bearer x"
    # The exporter package missing (an install without the `tracing` extra).
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
                        None)
    with pytest.raises(RuntimeError, match=r"pip install 'pdcluster\[tracing\]'"):
        TracingConfig.from_flag("http://127.0.0.1:4317")


@pytest.mark.parametrize(("env", "endpoint", "protocol", "used"), [
    ({}, "http://collector:4317", "grpc", "http://collector:4317"),
    ({}, "https://collector:4318/v1/traces", "http/protobuf",
     "https://collector:4318/v1/traces"),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, "http://collector:4318",
     "http/protobuf", "http://collector:4318/v1/traces"),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, "http://proxy/otlp/traces",
     "http/protobuf", "http://proxy/otlp/traces"),
    # The signal's own variable wins over the general one.
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
      "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}, "http://collector:4317", "grpc",
     "http://collector:4317"),
])
def test_the_protocol_follows_the_otel_variables_then_the_path(monkeypatch, env, endpoint,
                                                               protocol, used):
    for key in ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    config = TracingConfig.from_flag(endpoint)
    assert (config.protocol, config.endpoint) == (protocol, used)


@pytest.fixture
def http_receiver():
    receiver = OtlpHttpReceiver()
    yield receiver
    receiver.close()


def test_spans_reach_an_otlp_http_receiver(make_servers, http_receiver, monkeypatch):
    for key in ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        monkeypatch.delenv(key, raising=False)
    config = TracingConfig.from_flag(http_receiver.endpoint)  # `.../v1/traces`: OTLP/HTTP
    assert config.protocol == "http/protobuf"
    tracer = Tracer(config, "router")
    servers = make_servers(tracer=tracer)
    resp = httpx.post(f"http://127.0.0.1:{servers.http_port}/v1/completions", json={
        "model": "tiny", "prompt": "hello there", "max_tokens": 3, "ignore_eos": True},
        headers={"traceparent": traceparent(), "X-Request-Id": "traced-otlp-http"},
        timeout=30)
    assert resp.status_code == 200
    tracer.shutdown()
    spans = {s.name: s for s in http_receiver.trace(TRACE_ID, {"request", "admission",
                                                               "response"}, timeout_s=10)}
    request = spans["request"]
    assert request.parent_span_id == CLIENT_SPAN and request.kind == 2  # SERVER
    assert request.attributes["gen_ai.request.id"] == "traced-otlp-http"
    assert request.attributes["gen_ai.usage.completion_tokens"] == 3
    assert request.resource["service.name"] == "pdcluster-router"
    for child in ("admission", "response"):
        assert spans[child].parent_span_id == request.span_id
    assert {path for path, _ in http_receiver.requests} == {"/v1/traces"}
    assert {kind for _, kind in http_receiver.requests} == {"application/x-protobuf"}


def test_the_tracestate_is_kept_in_the_spans_context(http_receiver):
    tracer = Tracer(TracingConfig(http_receiver.endpoint, protocol="http/protobuf"), "router")
    state = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
    request = tracer.start("request", traceparent(), server=True, tracestate=state)
    assert request.tracestate == state
    # A child started from the span's own headers carries the same state.
    child = tracer.start("admission", request.traceparent, tracestate=request.tracestate)
    child.end()
    request.end()
    # Without a tracestate there is none, and the context is still the client's trace.
    plain = tracer.start("request", traceparent("2" * 32), server=True)
    assert plain.tracestate is None
    plain.end()
    tracer.shutdown()
    spans = {s.name: s for s in http_receiver.trace(TRACE_ID, {"request", "admission"},
                                                    timeout_s=10)}
    assert spans["request"].trace_state == spans["admission"].trace_state == state
    assert spans["admission"].parent_span_id == spans["request"].span_id
    (untraced,) = http_receiver.trace("2" * 32, {"request"}, timeout_s=10)
    assert untraced.trace_state == ""


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


def test_the_clients_tracestate_is_kept_in_the_request_spans(make_servers, http_receiver):
    tracer = Tracer(TracingConfig(http_receiver.endpoint, protocol="http/protobuf"), "router")
    servers = make_servers(tracer=tracer)
    state = "congo=t61rcWkgMzE"
    resp = httpx.post(f"http://127.0.0.1:{servers.http_port}/v1/completions", json={
        "model": "tiny", "prompt": "hello", "max_tokens": 2},
        headers={"traceparent": traceparent(), "tracestate": state}, timeout=30)
    assert resp.status_code == 200
    tracer.shutdown()
    spans = http_receiver.trace(TRACE_ID, {"request", "admission", "response"}, timeout_s=10)
    assert {s.trace_state for s in spans} == {state}
