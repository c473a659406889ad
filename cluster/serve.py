"""`pdcluster serve`: start Ray (embedded or existing), the pools, and the front doors."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ray
from rich.console import Console

from cluster.autoscaler import AutoscalerLoop, AutoscalerMetrics, RecordingBackend
from cluster.backend import ClusterBackend
from cluster.config import ClusterConfig
from cluster.metrics import VllmCompatCollector, WorkerCollector
from cluster.pool import Detached
from engine import load_generation_defaults
from engine.model_loader import cache_dir, resolve_model_dir
from planner.autoscale_policy import Autoscaler
from protocol.defaults import DRAIN_TIMEOUT_S
from router.auth import SecurityConfig, check_bind, is_loopback
from router.backend import Backend
from router.router import RouterConfig
from router.servers import Servers, start_servers

console = Console(stderr=True)


@dataclass(frozen=True)
class ServedModel:
    """One model of the cluster: its own pools and its router's settings.

    Args:
        cluster: its pools (workers, KV pools and prefix caches of its own).
        router: its admission limits and `served_model_name`.
    """

    cluster: ClusterConfig
    router: RouterConfig

    @property
    def name(self) -> str:
        return self.router.served_model_name or self.cluster.model


@dataclass(frozen=True)
class ServeOptions:
    """What `pdcluster serve` was asked for.

    Args:
        cluster: pool layout and engine settings.
        address: an existing Ray cluster (`auto`, `ray://...`), or None for an embedded one.
        host: interface the front doors bind.
        grpc_port: gRPC port (0 picks one).
        http_port: OpenAI HTTP port (0 picks one).
        router: admission limits and request timeout.
        metrics_compat: `vllm` also exports vLLM's metric names; None only pdcluster's.
        security: API / admin keys and TLS for both front doors.
        allow_unauthenticated: bind a non-loopback `host` without any key.
        drain_timeout_s: on SIGTERM/SIGINT, how long running requests may take to finish
            (new ones are refused meanwhile) before the servers stop.
        autoscaler: the autoscaling policy (`serve --autoscale`), or None.
        more_models: further models served beside the first (`cluster`, `router`), each
            with pools of its own; requests go to the model their `model` field names.
    """

    cluster: ClusterConfig
    address: str | None = None
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: int = 8000
    router: RouterConfig = field(default_factory=RouterConfig)
    metrics_compat: str | None = None
    autoscaler: Autoscaler | None = None
    security: SecurityConfig = field(default_factory=SecurityConfig)
    allow_unauthenticated: bool = False
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    more_models: tuple[ServedModel, ...] = ()

    def __post_init__(self) -> None:
        check_bind(self.host, self.security, self.allow_unauthenticated)
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.more_models and self.autoscaler is not None:
            raise ValueError("--autoscale serves one model; this config serves "
                             f"{len(self.models)}")
        names = [m.name for m in self.models]
        if len(set(names)) < len(names):
            raise ValueError(f"served-model-name: each model needs a name of its own, got "
                             f"{names}")

    @property
    def models(self) -> list[ServedModel]:
        """Every model served, the first (the default) first."""
        return [ServedModel(self.cluster, self.router), *self.more_models]


def check_tensor_parallel_sizes(cluster: ClusterConfig) -> None:
    """Refuse, before anything starts, a pool's tensor-parallel size the model's dimensions
    do not split into (`engine.parallel.check_tensor_parallel` names the one), or shared KV
    pages at a size that would replicate KV heads (`--tp-kv-pages shared`; `auto` takes
    private pages there); the model's config is read only when a pool is split.

    Raises:
        ValueError: naming the pool, the size and the dimension.
    """
    pools = (("colocated", cluster.decode),) if cluster.mode == "colocated" else (
        ("prefill", cluster.prefill), ("decode", cluster.decode))
    sizes = {name: pool.engine.get("tensor_parallel_size", 1) for name, pool in pools}
    if max(sizes.values()) <= 1:
        return
    from engine.model_loader import read_model_config
    from engine.parallel import check_tensor_parallel

    config, _ = read_model_config(resolve_model_dir(cluster.model))
    for (name, pool), size in zip(pools, sizes.values(), strict=True):
        try:
            check_tensor_parallel(config, size)
        except ValueError as e:
            raise ValueError(f"{name} workers: {e}") from None
        if pool.engine.get("tp_kv_pages") == "shared" and config.num_kv_heads % size:
            raise ValueError(
                f"{name} workers: tensor-parallel-size {size} does not divide the model's "
                f"{config.num_kv_heads} KV heads, so its ranks hold copies of them, which "
                "one shared pool cannot: use --tp-kv-pages private (or auto)")


def endpoint_file() -> Path:
    """Where a running `serve` writes its endpoints, so `generate`/`status` find it."""
    return cache_dir() / "endpoint.json"


def init_ray(address: str | None, num_workers: int) -> None:
    """Join `address`, or start an embedded local Ray sized for the pools and live scaling."""
    if address:
        ray.init(address=address, log_to_driver=False)
        return
    # Logical CPUs: one per worker with room to scale; threads are set per worker anyway.
    num_cpus = max(os.cpu_count() or 1, 4 * num_workers)
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)


async def run(options: ServeOptions, stop: asyncio.Event | None = None,
              detached: Detached | None = None,
              on_ready: Callable[[Servers, ClusterBackend], None] | None = None) -> None:
    """Serve until `stop` is set (or SIGINT/SIGTERM).

    Args:
        options: what to serve.
        stop: set to drain and stop; None: SIGINT/SIGTERM.
        detached: workers that outlive this process (`cluster.frontdoor`); None: they stop
            with it. One model only.
        on_ready: called once the servers listen and every worker is ready (with the first
            model's backend).
    """
    models = options.models
    if detached is not None and len(models) > 1:
        raise ValueError(f"--detach serves one model; this config serves {len(models)}")
    for model in models:
        with console.status(f"Preparing model {model.cluster.model!r}"):
            model_dir = resolve_model_dir(model.cluster.model)  # once here, not per worker
        # The folder's generation_config.json fails here, before any worker starts, rather
        # than in the router once they all have.
        load_generation_defaults(model.router.generation_config, model_dir,
                                 model.router.override_generation_config)
    num_workers = sum(m.cluster.num_workers for m in models)
    with console.status(f"Starting Ray and {num_workers} workers "
                        f"({', '.join(f'{m.name}: {m.cluster.mode}' for m in models)})"):
        own_ray = not ray.is_initialized()  # else: inside an actor (`cluster.frontdoor`)
        if own_ray:
            init_ray(options.address, num_workers)
        # After ray.init, whose native signal handlers would otherwise replace ours.
        stop = stop or _signal_event()
        backends = [ClusterBackend(m.cluster, m.router.served_model_name, detached)
                    for m in models]
        await asyncio.gather(*(b.start() for b in backends))
    backend = backends[0]
    front: Backend = backend if options.autoscaler is None else RecordingBackend(backend)
    more = [(b, m.router) for b, m in zip(backends[1:], models[1:], strict=True)]
    servers = await start_servers(front, options.host, options.grpc_port, options.http_port,
                                  options.router, options.security, backend.tracer, more)
    for router, each in zip(servers.routers, backends, strict=True):
        router.metrics.registry.register(WorkerCollector(each, router.metrics.model_name))
        if options.metrics_compat == "vllm":
            router.metrics.registry.register(VllmCompatCollector(each, router.metrics))
    metrics = servers.router.metrics
    autoscaling = None
    if options.autoscaler is not None:
        loop = AutoscalerLoop(options.autoscaler, front, AutoscalerMetrics(metrics.registry,
                                                                         metrics.model_name))
        autoscaling = asyncio.create_task(loop.run())
    console.print(f"Internal sockets: {backend.internal_security}")
    announce(options, servers.grpc_port, servers.http_port)
    if on_ready is not None:
        on_ready(servers, backend)
    try:
        await stop.wait()
        console.print(f"Draining: refusing new requests, waiting up to "
                      f"{options.drain_timeout_s:g} s for running ones")
        left = await servers.drain(options.drain_timeout_s)
        if left:
            console.print(f"{left} requests still running at the drain timeout: aborting them")
    finally:
        console.print("Shutting down")
        if autoscaling is not None:
            autoscaling.cancel()
        await servers.stop()
        await asyncio.gather(*(b.close() for b in backends))
        endpoint_file().unlink(missing_ok=True)
        if own_ray:
            ray.shutdown()


def announce(options: ServeOptions, grpc_port: int, http_port: int) -> None:
    """Write the endpoint file and print the ready line (which scripts wait for)."""
    security = options.security
    grpc_addr = f"{options.host}:{grpc_port}"
    http_addr = f"{'https' if security.tls else 'http'}://{options.host}:{http_port}"
    endpoint_file().parent.mkdir(parents=True, exist_ok=True)
    endpoint_file().write_text(json.dumps({"grpc": grpc_addr, "http": http_addr,
                                           "tls": security.tls}))
    if not security.authenticated:
        console.print("[yellow]No --api-key: anyone who can reach these ports may use them"
                      + (" (bound to this machine only)." if is_loopback(options.host)
                         else "."))
    tls = ("mutual TLS" if security.tls_client_ca else "TLS") if security.tls else "no TLS"
    print(f"pdcluster ready: gRPC {grpc_addr}  OpenAI {http_addr}/v1  "
          f"metrics {http_addr}/metrics  ({tls})", flush=True)


def _signal_event() -> asyncio.Event:
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, event.set)
    return event
