"""`pdcluster serve`: start Ray (embedded or existing), the pools, and the front doors."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

import ray
from rich.console import Console

from cluster.autoscaler import AutoscalerLoop, AutoscalerMetrics, RecordingBackend
from cluster.backend import ClusterBackend, ClusterConfig
from cluster.metrics import WorkerCollector
from engine.model_loader import cache_dir, resolve_model_dir
from planner.autoscale import Autoscaler
from router.backend import Backend
from router.frontend import RouterConfig
from router.servers import Servers, start_servers

console = Console(stderr=True)
TRANSPORTS = {"shm": ("shm", "zmq"), "zmq": ("zmq",), "torch": ("torch_dist", "zmq")}


@dataclass(frozen=True)
class ServeOptions:
    """What `pdcluster serve` was asked for.

    Args:
        cluster: pool layout and engine settings.
        address: an existing Ray cluster (`auto`, `ray://...`), or None for an embedded one.
        host: interface the front doors bind.
        grpc_port: gRPC port (0 picks one).
        http_port: OpenAI HTTP port (0 picks one).
        router: admission limits.
        autoscaler: the autoscaling policy (`serve --autoscale`), or None.
    """

    cluster: ClusterConfig
    address: str | None = None
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: int = 8000
    router: RouterConfig = field(default_factory=RouterConfig)
    autoscaler: Autoscaler | None = None


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


async def run(options: ServeOptions, stop: asyncio.Event | None = None) -> None:
    """Serve until `stop` is set (or SIGINT/SIGTERM)."""
    with console.status(f"Preparing model {options.cluster.model!r}"):
        resolve_model_dir(options.cluster.model)  # convert once here, not in every worker
    cfg = options.cluster
    num_workers = cfg.num_decode + (cfg.num_prefill if cfg.mode == "disaggregated" else 0)
    with console.status(f"Starting Ray and {num_workers} workers ({cfg.mode})"):
        init_ray(options.address, num_workers)
        # After ray.init, whose native signal handlers would otherwise replace ours.
        stop = stop or _signal_event()
        backend = ClusterBackend(cfg)
        await backend.start()
    front: Backend = backend if options.autoscaler is None else RecordingBackend(backend)
    servers = await start_servers(front, options.host, options.grpc_port, options.http_port,
                                  options.router)
    registry = servers.router.metrics.registry
    registry.register(WorkerCollector(backend))
    autoscaling = None
    if options.autoscaler is not None:
        loop = AutoscalerLoop(options.autoscaler, front, AutoscalerMetrics(registry))
        autoscaling = asyncio.create_task(loop.run())
    _announce(options, servers)
    try:
        await stop.wait()
    finally:
        console.print("Shutting down")
        if autoscaling is not None:
            autoscaling.cancel()
        await servers.stop()
        await backend.close()
        endpoint_file().unlink(missing_ok=True)
        ray.shutdown()


def _announce(options: ServeOptions, servers: Servers) -> None:
    grpc_addr = f"{options.host}:{servers.grpc_port}"
    http_addr = f"http://{options.host}:{servers.http_port}"
    endpoint_file().parent.mkdir(parents=True, exist_ok=True)
    endpoint_file().write_text(json.dumps({"grpc": grpc_addr, "http": http_addr}))
    print(f"pdcluster ready: gRPC {grpc_addr}  OpenAI {http_addr}/v1  "
          f"metrics {http_addr}/metrics", flush=True)


def _signal_event() -> asyncio.Event:
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, event.set)
    return event
