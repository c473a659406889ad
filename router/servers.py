"""Start the gRPC and HTTP front doors together, in the caller's event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from protocol.tracing import Tracer
from router.auth import SecurityConfig
from router.backend import Backend
from router.grpc_server import GrpcServer
from router.http_server import HttpServer
from router.models import Routers
from router.router import Router, RouterConfig


@dataclass
class Servers:
    """The running front doors; `stop()` ends both.

    Attributes:
        router: the first (default) model's router.
        routers: every served model's.
    """

    routers: Routers
    grpc: GrpcServer
    http: HttpServer

    @property
    def router(self) -> Router:
        return self.routers.default

    @property
    def grpc_port(self) -> int:
        return self.grpc.port

    @property
    def http_port(self) -> int:
        return self.http.port

    async def drain(self, timeout_s: float) -> int:
        """Health NOT_SERVING, new requests refused (UNAVAILABLE / 503); wait up to
        `timeout_s` for the running ones. Returns how many were still running."""
        for router in self.routers:
            router.draining = True
        await self.grpc.set_health()
        return await self.routers.drain(timeout_s)

    async def stop(self, grace: float = 1.0) -> None:
        """Stop both; streams still open after `grace` seconds are cancelled (and aborted)."""
        await asyncio.gather(self.grpc.stop(grace), self.http.stop(grace))

    async def wait(self) -> None:
        """Return when the gRPC server has terminated (after `stop`)."""
        await self.grpc.wait_for_termination()


async def start_servers(backend: Backend, host: str = "127.0.0.1", grpc_port: int = 0,
                        http_port: int = 0, config: RouterConfig | None = None,
                        security: SecurityConfig | None = None,
                        tracer: Tracer | None = None,
                        more_models: Sequence[tuple[Backend, RouterConfig]] = ()) -> Servers:
    """Serve `backend` over gRPC and OpenAI HTTP, one `Router` per model.

    Args:
        backend: what serves the requests.
        host: interface both servers bind.
        grpc_port: 0 picks a free port (see `Servers.grpc_port`).
        http_port: 0 picks a free port (see `Servers.http_port`).
        config: admission limits.
        security: keys and TLS for both servers (see `router.auth`); None for neither.
        tracer: the router's spans (`protocol.tracing`); None: no tracing.
        more_models: further models, each its backend and its router's config (its
            `served_model_name` must differ from the others'). Requests go to the router
            their `model` names.

    Returns:
        The running servers, with their bound ports.
    """
    routers = Routers([Router(backend, config, tracer)] + [
        Router(other, other_config, tracer) for other, other_config in more_models])
    grpc_server = GrpcServer(routers, host, grpc_port, security=security)
    http_server = HttpServer(routers, host, http_port, security)
    await grpc_server.start()
    await http_server.start()
    return Servers(routers, grpc_server, http_server)
