"""OpenTelemetry traces of a request across the router and the workers (`--otlp-traces-endpoint`).

Every process that takes part in a request (the router, each prefill and decode worker)
builds one `Tracer` for its role. Spans are exported over OTLP/gRPC by the OpenTelemetry SDK,
which also reads the standard `OTEL_EXPORTER_OTLP_*` variables (headers, certificates,
compression, timeout); the endpoint comes from the flag. The router takes a W3C
`traceparent` from the client's HTTP headers or gRPC metadata, opens the request's span as
its child, and sends the request span's own `traceparent` to the workers inside `Generate`
and `Prefill` (`protocol.messages`), so the workers' spans are children of it in the same
trace. Each process reports under its own service name, `pdcluster-<role>` (the prefix is
`OTEL_SERVICE_NAME` when set), with `pdcluster.role`, `pdcluster.worker_id` and
`process.pid` as resource attributes.

With tracing off a `Tracer` holds nothing, imports nothing of OpenTelemetry and hands out
one shared do-nothing span, so the request path pays a method call per span.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# The packages `--otlp-traces-endpoint` needs, as the `tracing` extra installs them.
INSTALL_HINT = "pip install 'pdcluster[tracing]' (opentelemetry-sdk and " \
               "opentelemetry-exporter-otlp-proto-grpc)"
TRACEPARENT = "traceparent"
_OTEL_PREFIX = "OTEL_"


@dataclass(frozen=True)
class TracingConfig:
    """Where spans go, and the OpenTelemetry settings the workers inherit.

    Args:
        endpoint: the OTLP/gRPC collector, e.g. `http://otel-collector:4317` (`http://`
            is plaintext, `https://` TLS).
        env: the `OTEL_*` variables of the process that read the flag; a worker sets each
            that its own environment lacks before it builds its exporter, so headers and
            certificates given to `serve` reach workers on other nodes too.
    """

    endpoint: str
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_flag(cls, endpoint: str | None) -> TracingConfig | None:
        """The config for `--otlp-traces-endpoint`; None when the flag is not given.

        Raises:
            ValueError: the endpoint is empty, or OTLP over a protocol other than gRPC is
                asked for (`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`).
            RuntimeError: the OpenTelemetry SDK or its OTLP/gRPC exporter is not installed;
                the message says what to install.
        """
        if endpoint is None:
            return None
        if not endpoint.strip():
            raise ValueError("--otlp-traces-endpoint: must not be empty")
        env = {k: v for k, v in os.environ.items() if k.startswith(_OTEL_PREFIX)}
        protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                           env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"))
        if protocol != "grpc":
            raise ValueError(f"OTLP protocol {protocol!r}: pdcluster exports traces over "
                             "grpc only; unset OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL")
        _exporter_class()  # fail here, before anything starts, when it is missing
        return cls(endpoint, env)


class Span:
    """One timed operation; a do-nothing span when tracing is off.

    `traceparent` is the W3C header that makes work elsewhere a child of this span.
    """

    traceparent: str | None = None

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
              **attributes: Any) -> Span:
        """Open a span; the caller ends it.

        Args:
            name: the operation (`request`, `admission`, `placement`, `prefill`,
                `kv_transfer`, `decode`, `response`).
            parent: the W3C `traceparent` of the parent span (from a client, or from the
                router's request span); None or malformed starts a new trace.
            server: the span serves a remote caller (the request span of a front door).
            attributes: span attributes (None values are left out).
        """
        if self._tracer is None:
            return NO_SPAN
        from opentelemetry.trace import SpanKind

        span = self._tracer.start_span(name, context=_context(parent),
                                       kind=SpanKind.SERVER if server else SpanKind.INTERNAL,
                                       attributes=_attributes(attributes))
        return _OtelSpan(span)

    def shutdown(self) -> None:
        """Export what is still buffered and stop the exporter."""
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = self._tracer = None


def _context(traceparent: str | None) -> Any:
    if not traceparent:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({TRACEPARENT: traceparent})


def _attributes(attributes: Mapping[str, object]) -> dict[str, object]:
    return {k: v for k, v in attributes.items() if v is not None}


def _exporter_class() -> Any:
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace import TracerProvider  # noqa: F401
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
    provider.add_span_processor(BatchSpanProcessor(_exporter_class()(endpoint=config.endpoint)))
    return provider
