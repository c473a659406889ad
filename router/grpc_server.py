"""The gRPC front door: `pdcluster.v1.PdCluster`, `grpc.health.v1` and server reflection."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from router.errors import RouterError
from router.frontend import Router
from router.proto.pdcluster.v1 import pdcluster_pb2 as pb
from router.proto.pdcluster.v1 import pdcluster_pb2_grpc as pb_grpc
from router.proto_convert import output_to_proto, params_from_proto, status_to_proto

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PdCluster"].full_name


class PdClusterServicer(pb_grpc.PdClusterServicer):
    """`pdcluster.v1.PdCluster` over a `Router`.

    Args:
        router: validation, admission and streaming.
    """

    def __init__(self, router: Router) -> None:
        self.router = router

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        try:
            prepared = self.router.prepare(
                **_inputs(request), params=params_from_proto(request.sampling_params),
                model=request.model or None,
                request_id=request.request_id if request.HasField("request_id") else None)
            outs = self.router.generate(prepared, context.time_remaining())
            async with aclosing(outs):
                async for out in outs:
                    yield output_to_proto(out)
        except RouterError as e:
            await _abort(context, e)

    async def Abort(self, request: pb.AbortRequest,
                    context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        try:
            await self.router.abort(request.request_id)
        except RouterError as e:
            await _abort(context, e)
        return pb.AbortResponse()

    async def Status(self, request: pb.StatusRequest,
                     context: grpc.aio.ServicerContext) -> pb.StatusResponse:
        return status_to_proto(await self.router.status())

    async def ScalePool(self, request: pb.ScalePoolRequest,
                        context: grpc.aio.ServicerContext) -> pb.StatusResponse:
        prefill = request.prefill if request.HasField("prefill") else None
        decode = request.decode if request.HasField("decode") else None
        try:
            return status_to_proto(await self.router.scale(prefill, decode))
        except RouterError as e:
            await _abort(context, e)
        except NotImplementedError as e:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, str(e))


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


class GrpcServer:
    """A grpc.aio server with the PdCluster, health and reflection services.

    Args:
        router: the shared router.
        host: interface to bind.
        port: port to bind; 0 picks a free one (see `port` after `start`).
        health_interval_s: how often the health status follows `router.healthy()`.
    """

    def __init__(self, router: Router, host: str = "127.0.0.1", port: int = 0,
                 health_interval_s: float = 1.0) -> None:
        self.router = router
        self.health = health.aio.HealthServicer()
        self._interval = health_interval_s
        self._server = grpc.aio.server()
        pb_grpc.add_PdClusterServicer_to_server(PdClusterServicer(router), self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server)
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        self._health_task: asyncio.Task | None = None

    async def start(self) -> None:
        """Serve, and keep the health status in step with the backend."""
        await self._set_health()
        await self._server.start()
        self._health_task = asyncio.create_task(self._follow_health())

    async def _follow_health(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self._set_health()

    async def _set_health(self) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if self.router.healthy()
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
