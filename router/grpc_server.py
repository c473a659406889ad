"""The gRPC front door: `pdcluster.v1.PdCluster`, `grpc.health.v1` and server reflection."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protocol.tracing import TRACEPARENT, TRACESTATE
from router.auth import Access, SecurityConfig, bearer_token
from router.errors import RouterError
from router.models import Routers
from router.proto.pdcluster.v1 import pdcluster_pb2 as pb
from router.proto.pdcluster.v1 import pdcluster_pb2_grpc as pb_grpc
from router.proto_convert import output_to_proto, params_from_proto, status_to_proto

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PdCluster"].full_name


class PdClusterServicer(pb_grpc.PdClusterServicer):
    """`pdcluster.v1.PdCluster` over the served models' routers.

    Args:
        routers: validation, admission and streaming, one per model (by the request's
            `model`).
    """

    def __init__(self, routers: Routers) -> None:
        self.routers = routers

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        try:
            router = self.routers.get(request.model)
            metadata = dict(context.invocation_metadata() or ())
            prepared = router.prepare(
                **_inputs(request), params=params_from_proto(request.sampling_params),
                model=request.model or None,
                request_id=request.request_id if request.HasField("request_id") else None,
                traceparent=metadata.get(TRACEPARENT), tracestate=metadata.get(TRACESTATE))
            outs = router.generate(prepared, context.time_remaining())
            async with aclosing(outs):
                async for out in outs:
                    yield output_to_proto(out)
        except RouterError as e:
            await _abort(context, e)

    async def Abort(self, request: pb.AbortRequest,
                    context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        try:
            await self.routers.holding(request.request_id).abort(request.request_id)
        except RouterError as e:
            await _abort(context, e)
        return pb.AbortResponse()

    async def Status(self, request: pb.StatusRequest,
                     context: grpc.aio.ServicerContext) -> pb.StatusResponse:
        try:  # no model named: the first one's, whose `models` lists them all
            router = self.routers.get(request.model) if request.model else self.routers.default
        except RouterError as e:
            await _abort(context, e)
        return status_to_proto(self._with_models(await router.status()))

    async def ScalePool(self, request: pb.ScalePoolRequest,
                        context: grpc.aio.ServicerContext) -> pb.StatusResponse:
        prefill = request.prefill if request.HasField("prefill") else None
        decode = request.decode if request.HasField("decode") else None
        try:
            router = self.routers.get(request.model)
            return status_to_proto(self._with_models(await router.scale(prefill, decode)))
        except RouterError as e:
            await _abort(context, e)
        except NotImplementedError as e:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, str(e))

    def _with_models(self, status: dict[str, Any]) -> dict[str, Any]:
        """A model's status, and the names of every served model (`models`)."""
        return {**status, "models": list(self.routers.by_name)}


def _inputs(request: pb.GenerateRequest) -> dict[str, Any]:
    which = request.WhichOneof("input")
    if which == "prompt":
        return {"prompt": request.prompt}
    if which == "prompt_token_ids":
        return {"prompt_token_ids": list(request.prompt_token_ids.ids)}
    if which == "messages":
        return {"messages": [{"role": m.role, "content": m.content}
                             for m in request.messages.messages]}
    return {}


async def _abort(context: grpc.aio.ServicerContext, error: RouterError) -> None:
    """Ends the call with the error's status (`context.abort` raises)."""
    await context.abort(grpc.StatusCode[error.code.upper()], str(error))


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks the `authorization: Bearer <key>` metadata of every PdCluster call.

    Health and reflection stay open. A missing or wrong key gets UNAUTHENTICATED; the API
    key on `ScalePool` gets PERMISSION_DENIED.

    Args:
        security: the keys.
    """

    def __init__(self, security: SecurityConfig) -> None:
        self.security = security

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        metadata = dict(details.invocation_metadata or ())
        access = self.security.access(bearer_token(metadata.get("authorization")))
        needed = Access.ADMIN if details.method.endswith("/ScalePool") else Access.USER
        if access >= needed:
            return handler
        if access == Access.NONE:
            return _denied(handler, grpc.StatusCode.UNAUTHENTICATED,
                           "a valid key is required: metadata 'authorization: Bearer <key>'")
        return _denied(handler, grpc.StatusCode.PERMISSION_DENIED,
                       "ScalePool needs the admin key (--admin-key), not the API key")


def _denied(handler: grpc.RpcMethodHandler, code: grpc.StatusCode,
            details: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only refuses the call."""
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, details)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        await context.abort(code, details)
        yield  # never reached; makes this a streaming handler

    serde = {"request_deserializer": handler.request_deserializer,
             "response_serializer": handler.response_serializer}
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream, **serde)
    return grpc.unary_unary_rpc_method_handler(unary, **serde)


class _Malformed:
    """Stands in for a request whose bytes did not parse."""

    def __init__(self, error: str) -> None:
        self.error = error


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Answers INVALID_ARGUMENT to request bytes that are not the method's message.

    gRPC itself would answer UNKNOWN and log a traceback for every such call.
    """

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None \
                or not (handler.unary_unary or handler.unary_stream):
            return handler
        parse = handler.request_deserializer

        def lenient(data: bytes) -> Any:
            try:
                return parse(data)
            except DecodeError as e:
                return _Malformed(str(e))

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request: not a valid protobuf message ({request.error})")

        serde = {"request_deserializer": lenient,
                 "response_serializer": handler.response_serializer}
        if handler.unary_stream:
            inner_stream = handler.unary_stream

            async def stream(request: Any, context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[Any]:
                if isinstance(request, _Malformed):
                    await refuse(request, context)
                async for response in inner_stream(request, context):
                    yield response
            return grpc.unary_stream_rpc_method_handler(stream, **serde)
        inner_unary = handler.unary_unary

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                await refuse(request, context)
            return await inner_unary(request, context)
        return grpc.unary_unary_rpc_method_handler(unary, **serde)


class GrpcServer:
    """A grpc.aio server with the PdCluster, health and reflection services.

    Args:
        routers: the served models' routers.
        host: interface to bind.
        port: port to bind; 0 picks a free one (see `port` after `start`).
        health_interval_s: how often the health status follows `routers.healthy()`.
        security: keys (checked by `AuthInterceptor`) and TLS; None for neither.
    """

    def __init__(self, routers: Routers, host: str = "127.0.0.1", port: int = 0,
                 health_interval_s: float = 1.0, security: SecurityConfig | None = None) -> None:
        self.routers = routers
        self.health = health.aio.HealthServicer()
        self._interval = health_interval_s
        security = security or SecurityConfig()
        # Clients' keepalive pings (`router.client.KEEPALIVE_OPTIONS`, every 30 s while a
        # call is open) are welcome even while a long prompt sends nothing back.
        self._server = grpc.aio.server(
            interceptors=[MalformedRequestInterceptor(), AuthInterceptor(security)],
            options=[("grpc.http2.min_ping_interval_without_data_ms", 20_000)])
        pb_grpc.add_PdClusterServicer_to_server(PdClusterServicer(routers), self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server)
        address = f"{host}:{port}"
        self.port = self._server.add_secure_port(address, security.grpc_credentials()) \
            if security.tls else self._server.add_insecure_port(address)
        self._health_task: asyncio.Task | None = None

    async def start(self) -> None:
        """Serve, and keep the health status in step with the backend."""
        await self.set_health()
        await self._server.start()
        self._health_task = asyncio.create_task(self._follow_health())

    async def _follow_health(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self.set_health()

    async def set_health(self) -> None:
        """Publish `routers.healthy()` now (e.g. NOT_SERVING as a drain starts)."""
        status = (health_pb2.HealthCheckResponse.SERVING if self.routers.healthy()
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    async def stop(self, grace: float | None = 1.0) -> None:
        """Report NOT_SERVING, then stop; streams still open after `grace` seconds are cancelled."""
        if self._health_task is not None:
            self._health_task.cancel()
        await self.health.enter_graceful_shutdown()
        await self._server.stop(grace)

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()
