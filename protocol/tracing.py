"""OpenTelemetry traces of a request across the router and the workers (`--otlp-traces-endpoint`).

Every process that takes part in a request (the router, each prefill and decode worker)
builds one `Tracer` for its role. Spans are exported by the OpenTelemetry SDK over OTLP/gRPC
(port 4317 by convention) or OTLP/HTTP (`http/protobuf`, port 4318, path `/v1/traces`): the
standard `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` (else `OTEL_EXPORTER_OTLP_PROTOCOL`) picks it,
and without either an endpoint whose path is `/v1/traces` means OTLP/HTTP. The SDK also reads
the other `OTEL_EXPORTER_OTLP_*` variables (headers, certificates, compression, timeout); the
endpoint comes from the flag. The router takes a W3C `traceparent` from the client's HTTP
headers or gRPC metadata, opens the request's span as its child (with the client's
`tracestate`, when given to `Tracer.start`, kept in the span's context and its children's),
and sends the request span's own `traceparent` to the workers inside `Generate` and
`Prefill` (`protocol.messages`), so the workers' spans are children of it in the same
trace. Each process reports under its own service name, `pdcluster-<role>` (the prefix is
`OTEL_SERVICE_NAME` when set), with `pdcluster.role`, `pdcluster.worker_id` and
`process.pid` as resource attributes.

With tracing off a `Tracer` holds nothing, imports nothing of OpenTelemetry and hands out
one shared do-nothing span, so the request path pays a method call per span.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

# The packages `--otlp-traces-endpoint` needs, as the `tracing` extra installs them.
INSTALL_HINT = "pip install 'pdcluster[tracing]' (opentelemetry-sdk, " \
               "opentelemetry-exporter-otlp-proto-grpc and -proto-http)"
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
GRPC, HTTP_PROTOBUF = "grpc", "http/protobuf"
OTLP_HTTP_PATH = "/v1/traces"
# version-trace id-parent id-flags, as OpenTelemetry's propagator reads it (lowercase hex).
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}(?:-.*)?")
_OTEL_PREFIX = "OTEL_"


@dataclass(frozen=True)
class TracingConfig:
    """Where spans go, and the OpenTelemetry settings the workers inherit.

    Args:
        endpoint: the collector, e.g. `http://otel-collector:4317` for OTLP/gRPC or
            `http://otel-collector:4318/v1/traces` for OTLP/HTTP (`http://` is plaintext,
            `https://` TLS).
        env: the `OTEL_*` variables of the process that read the flag; a worker sets each
            that its own environment lacks before it builds its exporter, so headers and
            certificates given to `serve` reach workers on other nodes too.
        protocol: `grpc` or `http/protobuf`.
    """

    endpoint: str
    env: dict[str, str] = field(default_factory=dict)
    protocol: str = GRPC

    @classmethod
    def from_flag(cls, endpoint: str | None) -> TracingConfig | None:
        """The config for `--otlp-traces-endpoint`; None when the flag is not given.

        The protocol is `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, else
        `OTEL_EXPORTER_OTLP_PROTOCOL`, else `http/protobuf` for an `http(s)://` endpoint
        whose path is `/v1/traces` and `grpc` for any other. An OTLP/HTTP endpoint without
        a path gets `/v1/traces`; one with a path is used as it is.

        Raises:
            ValueError: the endpoint is empty, or the protocol is neither `grpc` nor
                `http/protobuf` (`http/json` is not supported).
            RuntimeError: the OpenTelemetry SDK or the protocol's OTLP exporter is not
                installed; the message says what to install.
        """
        if endpoint is None:
            return None
        endpoint = endpoint.strip()
        if not endpoint:
            raise ValueError("--otlp-traces-endpoint: must not be empty")
        env = {k: v for k, v in os.environ.items() if k.startswith(_OTEL_PREFIX)}
        url = urlsplit(endpoint)
        web = url.scheme in ("http", "https")
        protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or \
            env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or \
            (HTTP_PROTOBUF if web and url.path.rstrip("/") == OTLP_HTTP_PATH else GRPC)
        if protocol not in (GRPC, HTTP_PROTOBUF):
            raise ValueError(f"OTLP protocol {protocol!r}: pdcluster exports traces over "
                             f"{GRPC} or {HTTP_PROTOBUF}; set "
                             "OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL to one of them")
        if protocol == HTTP_PROTOBUF:
            if not web:
                raise ValueError(f"--otlp-traces-endpoint {endpoint!r}: OTLP/HTTP needs an "
                                 "http:// or https:// URL")
            if url.path in ("", "/"):
                endpoint = urlunsplit(url._replace(path=OTLP_HTTP_PATH))
        _exporter_class(protocol)  # fail here, before anything starts, when it is missing
        return cls(endpoint, env, protocol)


class Span:
    """One timed operation; a do-nothing span when tracing is off.

    `traceparent` is the W3C header that makes work elsewhere a child of this span;
    `tracestate` the W3C vendor state its context carries (None when empty).
    """

    traceparent: str | None = None
    tracestate: str | None = None

    def set(self, **attributes: Any) -> None:
        """Add attributes (None values are left out)."""

    def end(self, error: str | None = None, **attributes: Any) -> None:
        """Close the span, with an error status when `error` is given; once (later calls
        do nothing)."""


NO_SPAN = Span()


class _OtelSpan(Span):
    def __init__(self, span: Any) -> None:
        self._span = span
        self._ended = False

    @property  # type: ignore[override]
    def traceparent(self) -> str | None:
        context = self._span.get_span_context()
        return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"

    @property  # type: ignore[override]
    def tracestate(self) -> str | None:
        return self._span.get_span_context().trace_state.to_header() or None

    def set(self, **attributes: Any) -> None:
        self._span.set_attributes(_attributes(attributes))

    def end(self, error: str | None = None, **attributes: Any) -> None:
        from opentelemetry.trace import Status, StatusCode

        if self._ended:
            return
        self._ended = True
        if attributes:
            self.set(**attributes)
        if error is not None:
            self._span.set_status(Status(StatusCode.ERROR, error))
        self._span.end()


class Tracer:
    """Starts spans for one process and role; do-nothing without a config.

    Args:
        config: where spans go; None turns tracing off.
        role: `router`, `prefill`, `decode` or `mixed`: the service name's suffix.
        worker_id: the worker's id (a resource attribute); None for the router.
    """

    def __init__(self, config: TracingConfig | None, role: str,
                 worker_id: str | None = None) -> None:
        self.enabled = config is not None
        self._provider: Any = None
        self._tracer: Any = None
        if config is not None:
            self._provider = _provider(config, role, worker_id)
            self._tracer = self._provider.get_tracer("pdcluster")

    def start(self, name: str, parent: str | None, server: bool = False,
              tracestate: str | None = None, **attributes: Any) -> Span:
        """Open a span; the caller ends it.

        Args:
            name: the operation (`request`, `admission`, `placement`, `prefill`,
                `kv_transfer`, `decode`, `response`).
            parent: the W3C `traceparent` of the parent span (from a client, or from the
                router's request span); None or malformed starts a new trace.
            server: the span serves a remote caller (the request span of a front door).
            tracestate: the W3C `tracestate` that came with `parent`; the span's context
                keeps it (and hands it to the span's children).
            attributes: span attributes (None values are left out).
        """
        if self._tracer is None:
            return NO_SPAN
        from opentelemetry.trace import SpanKind

        span = self._tracer.start_span(name, context=_context(parent, tracestate),
                                       kind=SpanKind.SERVER if server else SpanKind.INTERNAL,
                                       attributes=_attributes(attributes))
        return _OtelSpan(span)

    def shutdown(self) -> None:
        """Export what is still buffered and stop the exporter."""
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = self._tracer = None


def trace_id(traceparent: str | None) -> str | None:
    """The 32-hex trace id of a W3C `traceparent` (`00-<trace id>-<span id>-<flags>`); None
    for a missing or malformed one, or the all-zero id the standard calls invalid."""
    match = _TRACEPARENT.fullmatch((traceparent or "").strip())
    if match is None or match[1] == "ff" or match[2] == "0" * 32 or match[3] == "0" * 16:
        return None
    return match[2]


def _context(traceparent: str | None, tracestate: str | None = None) -> Any:
    if not traceparent:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {TRACEPARENT: traceparent}
    if tracestate:
        carrier[TRACESTATE] = tracestate
    return TraceContextTextMapPropagator().extract(carrier)


def _attributes(attributes: Mapping[str, object]) -> dict[str, object]:
    return {k: v for k, v in attributes.items() if v is not None}


def _exporter_class(protocol: str = GRPC) -> Any:
    try:
        from opentelemetry.sdk.trace import TracerProvider  # noqa: F401

        if protocol == HTTP_PROTOBUF:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError as e:
        raise RuntimeError(f"--otlp-traces-endpoint needs OpenTelemetry: {INSTALL_HINT} "
                           f"({e})") from e
    return OTLPSpanExporter


def _provider(config: TracingConfig, role: str, worker_id: str | None) -> Any:
    for key, value in config.env.items():
        os.environ.setdefault(key, value)
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    prefix = os.environ.get("OTEL_SERVICE_NAME") or "pdcluster"
    resource = Resource.create(_attributes({
        "service.name": f"{prefix}-{role}", "pdcluster.role": role,
        "pdcluster.worker_id": worker_id, "service.instance.id": worker_id,
        "process.pid": os.getpid()}))
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(
        _exporter_class(config.protocol)(endpoint=config.endpoint)))
    return provider
