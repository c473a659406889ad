"""A small typed gRPC client for `pdcluster.v1` (used by the CLI, benchmarks and tests)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.outputs import GenerateOutput
from router.proto.pdcluster.v1 import pdcluster_pb2 as pb
from router.proto.pdcluster.v1 import pdcluster_pb2_grpc as pb_grpc
from router.proto_convert import output_from_proto, status_from_proto

# The calls that may be sent again (`Status`, `Abort`, `ScalePool` to absolute sizes, health
# checks) are retried by gRPC itself while the server is UNAVAILABLE, e.g. a front door
# restarting: 5 attempts (gRPC's own ceiling; more is clamped, with an error logged), the
# waits between them drawn up to 0.25, 0.5, 1 and 2 s. `Generate` is never sent twice.
_RETRY_POLICY = {"methodConfig": [{
    "name": [{"service": "pdcluster.v1.PdCluster", "method": method}
             for method in ("Status", "Abort", "ScalePool")]
    + [{"service": "grpc.health.v1.Health"}],
    "retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.25s", "maxBackoff": "2s",
                    "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}]}
# Keepalive pings on a channel with calls in flight, so a long stream notices a peer that
# vanished without closing (a node lost) within about 40 s; the server allows them.
KEEPALIVE_OPTIONS = (("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 10_000))
_CHANNEL_OPTIONS = (("grpc.enable_retries", 1),
                    ("grpc.service_config", json.dumps(_RETRY_POLICY)), *KEEPALIVE_OPTIONS)
_NO_RETRY_OPTIONS = (("grpc.enable_retries", 0), *KEEPALIVE_OPTIONS)


class PdClusterClient:
    """Blocking client over one channel; errors surface as `grpc.RpcError` with the server's
    status code (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, NOT_FOUND, ...). `status`, `abort`,
    `scale` and `health` are retried while the server is UNAVAILABLE (`_RETRY_POLICY`),
    unless `retries` is off.

    Args:
        address: `host:port` of the gRPC server.
        timeout: default deadline in seconds for every call; None for none.
        api_key: sent as `authorization: Bearer <key>` on every call.
        admin_key: sent instead on `scale` (ScalePool needs it when the server has one).
        tls: connect with TLS (implied by any of the three files below).
        tls_ca: CA bundle (PEM) to verify the server with; None uses the system's roots.
        tls_cert: client certificate (PEM) for mutual TLS.
        tls_key: its private key (PEM).
        retries: retry the calls above while the server is UNAVAILABLE; False: every call
            is tried once (a probe that must answer now, not within seconds).
    """

    def __init__(self, address: str, timeout: float | None = None, *,
                 api_key: str | None = None, admin_key: str | None = None, tls: bool = False,
                 tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, retries: bool = True) -> None:
        self.address = address
        self.timeout = timeout
        self._auth = _bearer(api_key)
        self._admin_auth = _bearer(admin_key) or self._auth
        options = _CHANNEL_OPTIONS if retries else _NO_RETRY_OPTIONS
        if tls or tls_ca or tls_cert or tls_key:
            credentials = grpc.ssl_channel_credentials(
                _read(tls_ca), _read(tls_key), _read(tls_cert))
            self._channel = grpc.secure_channel(address, credentials, options)
        else:
            self._channel = grpc.insecure_channel(address, options)
        self._stub = pb_grpc.PdClusterStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def generate(self, prompt: str | None = None, messages: list[dict[str, str]] | None = None,
                 prompt_token_ids: list[int] | None = None, *, request_id: str | None = None,
                 model: str = "", timeout: float | None = None,
                 traceparent: str | None = None,
                 **sampling: Any) -> Iterator[GenerateOutput]:
        """Stream a request's outputs; the last has finish_reason, usage and timings.

        Args:
            prompt: text; or
            messages: a chat (`[{"role": ..., "content": ...}]`); or
            prompt_token_ids: token ids.
            request_id: the id to use (for `abort`); None lets the server pick.
            model: the model asked for; empty for the served one.
            timeout: deadline for the whole stream; defaults to the client's.
            traceparent: a W3C `traceparent` sent as metadata: the server's spans for the
                request join that trace.
            **sampling: SamplingParams fields (max_tokens, temperature, stop, ...).

        Returns:
            The outputs as they arrive; closing the iterator cancels the call (and the
            request).

        Raises:
            ValueError: more than one of prompt, messages, prompt_token_ids.
        """
        request = _generate_request(prompt, messages, prompt_token_ids, request_id, model,
                                    sampling)
        metadata = (*(self._auth or ()), *([("traceparent", traceparent)] if traceparent else []))
        call = self._stub.Generate(request, timeout=timeout or self.timeout,
                                   metadata=metadata or None)
        try:
            for msg in call:
                yield output_from_proto(msg)
        finally:
            call.cancel()

    def generate_text(self, prompt: str | None = None,
                      messages: list[dict[str, str]] | None = None,
                      prompt_token_ids: list[int] | None = None, **kwargs: Any) -> str:
        """The whole generated text (same arguments as `generate`).

        Raises:
            RuntimeError: the request ended with finish_reason `error`.
        """
        parts = []
        for out in self.generate(prompt, messages, prompt_token_ids, **kwargs):
            parts.append(out.text)
            if out.finish_reason == "error":
                raise RuntimeError(f"generation failed: {out.error}")
        return "".join(parts)

    def abort(self, request_id: str) -> None:
        """End a queued or running request (grpc.RpcError NOT_FOUND when unknown)."""
        self._stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self.timeout,
                         metadata=self._auth)

    def status(self, model: str = "") -> dict[str, Any]:
        """Model, mode, the router's queue and each pool's workers, of `model` ("": the
        first served); `models` names every served model."""
        return status_from_proto(self._stub.Status(pb.StatusRequest(model=model),
                                                   timeout=self.timeout, metadata=self._auth))

    def scale(self, prefill: int | None = None, decode: int | None = None,
              model: str = "") -> dict[str, Any]:
        """Resize `model`'s pools (None leaves one as it is; "": the one model served, which
        several served models refuse); returns its new status."""
        request = pb.ScalePoolRequest(prefill=prefill, decode=decode, model=model)
        return status_from_proto(self._stub.ScalePool(request, timeout=self.timeout,
                                                      metadata=self._admin_auth))

    def health(self, service: str = "") -> str:
        """`SERVING` or `NOT_SERVING` (grpc.health.v1); "" asks about the whole server."""
        reply = self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                   timeout=self.timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> PdClusterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _bearer(key: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {key}"),) if key else None


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def _generate_request(prompt: str | None, messages: list[dict[str, str]] | None,
                      prompt_token_ids: list[int] | None, request_id: str | None, model: str,
                      sampling: dict[str, Any]) -> pb.GenerateRequest:
    if sum(x is not None for x in (prompt, messages, prompt_token_ids)) > 1:
        raise ValueError("give only one of prompt, messages or prompt_token_ids")
    if isinstance(sampling.get("stop"), str):  # one stop string, not its characters
        sampling = {**sampling, "stop": [sampling["stop"]]}
    if sampling.get("logit_bias"):  # JSON-style string keys are token ids too
        sampling = {**sampling, "logit_bias": {int(k): v
                                               for k, v in sampling["logit_bias"].items()}}
    params = pb.SamplingParams(**{k: v for k, v in sampling.items() if v is not None})
    request = pb.GenerateRequest(model=model, request_id=request_id, sampling_params=params)
    if prompt is not None:
        request.prompt = prompt
    if messages is not None:
        request.messages.CopyFrom(pb.ChatMessages(messages=[pb.ChatMessage(**m)
                                                            for m in messages]))
    if prompt_token_ids is not None:
        request.prompt_token_ids.CopyFrom(pb.TokenIds(ids=prompt_token_ids))
    return request
