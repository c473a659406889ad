"""`pdcluster serve --detach`: the front door as a detached Ray actor that Ray restarts.

The front door (router, gRPC and HTTP servers, autoscaler: `cluster.serve.run`) runs on a
thread of the `FrontDoor` actor, named `NAME-frontdoor` in the `pdcluster` namespace,
detached and with `max_restarts=-1`; the workers are detached actors named
`NAME-worker-ID`. The launcher can exit or be killed: nothing it owns serves.

A front door that dies (its process killed, its node's OOM killer) is started again by
Ray. The new one reads what the first one recorded in the `NAME-registry` actor (its ports,
the cluster's CURVE key), binds the same ports and adopts the live workers by their names
(`WorkerPool.adopt`): no worker restarts and no model is loaded again. The streams that
were open on the dead one end with a broken connection; the workers end those requests and
free their KV when they are adopted.

`pdcluster drain` drains the front door in place, for a front-door pod's preStop hook:
health `NOT_SERVING`, new requests refused (503 with `retry-after` / `UNAVAILABLE`), the
running ones finish (up to the drain timeout); the workers go on. A drained front door stays
drained until its process ends (its pod's Ray stops); Ray then restarts the actor on the
replacement pod, in a new process that serves: the drain is recorded nowhere else.
`pdcluster stop` drains the front door, stops the workers and removes every actor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from protocol.defaults import DRAIN_TIMEOUT_S
from protocol.logs import configure_logging

if TYPE_CHECKING:  # the front door's runtime, imported where it runs: `stop` and `drain`
    # (a pod's preStop hook) start in a fraction of the time without it
    from cluster.backend import ClusterBackend
    from cluster.serve import ServeOptions
    from router.servers import Servers

log = logging.getLogger(__name__)

NAMESPACE = "pdcluster"
DEFAULT_NAME = "pdcluster"
# Nodes that offer this custom resource host the front door (a Kubernetes pod of its own,
# with the probes and the Service: deploy/kuberay); without one, the launcher's node does.
FRONTDOOR_RESOURCE = "pd_frontdoor"
# What Ray's head node offers and no other node does.
HEAD_RESOURCE = "node:__internal_head__"


def frontdoor_name(name: str) -> str:
    return f"{name}-frontdoor"


def registry_name(name: str) -> str:
    return f"{name}-registry"


def worker_prefix(name: str) -> str:
    return f"{name}-worker-"


@ray.remote(num_cpus=0)
class Registry:
    """What a restarted front door needs from the first one: ports and the cluster key."""

    def __init__(self) -> None:
        self.record: dict[str, Any] | None = None

    def get(self) -> dict[str, Any] | None:
        return self.record

    def put(self, record: dict[str, Any]) -> None:
        self.record = record


@ray.remote(num_cpus=0, max_concurrency=4)
class FrontDoor:
    """Serves `options` on a thread of its own from construction on, so a restart by Ray
    (which only constructs it again) serves again without anyone calling it.

    Args:
        options: what `pdcluster serve` was asked for.
        name: the cluster's name (its actors' names start with it).

    Its log takes the level and format every process of the cluster takes
    (`options.cluster.log`); the actor's lines land in Ray's logs.
    """

    def __init__(self, options: ServeOptions, name: str) -> None:
        configure_logging(options.cluster.log.level, options.cluster.log.format)
        logging.getLogger("cluster.autoscaler").setLevel(logging.INFO)
        self.name = name
        self.drain_timeout_s = options.drain_timeout_s
        self.endpoints: dict[str, Any] | None = None
        self.error: str | None = None
        self.started = time.time()
        self._ready = threading.Event()
        self._restarted = self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._servers: Servers | None = None
        self._thread = threading.Thread(target=self._serve, args=(options,), daemon=True,
                                        name="frontdoor")
        self._thread.start()

    def _serve(self, options: ServeOptions) -> None:
        try:
            asyncio.run(self._run(options))
        except BaseException as e:
            log.exception("the front door failed")
            self.error = f"{type(e).__name__}: {e}"
            if (self._restarted or self.endpoints is not None) and not self._stopping:
                # It served before: end the process, so Ray starts a new front door. (A
                # first start's failure goes to the launcher through `ready` instead.)
                os._exit(1)
        finally:
            self._ready.set()

    async def _run(self, options: ServeOptions) -> None:
        from cluster.pool import Detached
        from cluster.serve import run

        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        registry = ray.get_actor(registry_name(self.name))
        record = await registry.get.remote()
        self._restarted = record is not None
        if record is not None:  # a restart: the same ports, the workers' key
            options = replace(options, grpc_port=record["grpc_port"],
                              http_port=record["http_port"])
        detached = Detached(worker_prefix(self.name),
                            record["cluster_key"] if record else None, record is not None)

        def on_ready(servers: Servers, backend: ClusterBackend) -> None:
            self.endpoints = {"grpc_port": servers.grpc_port, "http_port": servers.http_port,
                              "pid": os.getpid(), "restarted": record is not None,
                              "started": self.started}
            if record is None:
                registry.put.remote({"grpc_port": servers.grpc_port,
                                     "http_port": servers.http_port,
                                     "cluster_key": backend.pool.cluster_key})
            self._servers = servers
            self._ready.set()
        await run(options, self._stop, detached, on_ready)

    def ready(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """Its ports (and pid) once it serves.

        Raises:
            RuntimeError: it failed to start, or was not ready within `timeout_s`.
        """
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f"the front door was not ready after {timeout_s:g} s")
        if self.endpoints is None or self.error is not None:
            raise RuntimeError(f"the front door failed to start: {self.error}")
        return self.endpoints

    def drain(self, timeout_s: float | None = None) -> int:
        """Stop admitting and wait for the running requests, leaving the workers running:
        health `NOT_SERVING`, new requests refused as in `serve`'s SIGTERM drain. It stays
        drained until this process ends; the process Ray restarts the actor in serves.

        Args:
            timeout_s: how long the running requests may take; None: the front door's own
                `--drain-timeout`.

        Returns:
            How many requests were still running at the timeout (they go on until the
            process ends).

        Raises:
            RuntimeError: it does not serve (still starting, failed, or stopping), or its
                event loop did not answer.
        """
        timeout_s = self.drain_timeout_s if timeout_s is None else timeout_s
        started = time.monotonic()
        if not self._ready.wait(timeout_s) or self._servers is None or self._loop is None:
            raise RuntimeError(f"the front door does not serve ({self.error or 'starting'})")
        if self._stopping:
            raise RuntimeError("the front door is stopping")
        left_s = max(timeout_s - (time.monotonic() - started), 0.0)
        log.info("draining: refusing new requests, waiting up to %g s for running ones",
                 left_s)
        done = asyncio.run_coroutine_threadsafe(self._servers.drain(left_s), self._loop)
        try:
            # Beyond the drain's own timeout only when the event loop is stuck.
            left = done.result(left_s + 30)
        except TimeoutError:
            done.cancel()
            raise RuntimeError("the front door's event loop did not answer") from None
        log.info("drained: %d requests still running; refusing new ones until this "
                 "process ends", left)
        return left

    def shutdown(self, timeout_s: float = 600.0) -> None:
        """Drain, stop the workers and the servers (then the caller kills the actor)."""
        self._stopping = True
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout_s)


def launch(options: ServeOptions, name: str = DEFAULT_NAME,
           ready_timeout_s: float = 600.0) -> dict[str, Any]:
    """Start a detached cluster on the Ray cluster at `options.address` and return its
    endpoints once it serves; the caller may then exit. Where a cluster of that name
    already runs, wait for it instead (its own settings stay): a launcher run again, as a
    Kubernetes Job retries, changes nothing.

    The front door runs on a node offering `pd_frontdoor` (its own pod on Kubernetes,
    `deploy/kuberay`), else on this process's node.

    Returns:
        `FrontDoor.ready`'s answer, plus `existing`: whether it was already running.

    Raises:
        ValueError: no `options.address`.
        RuntimeError: the front door failed to start (the cluster is removed again).
    """
    if not options.address:
        raise ValueError("--detach needs a running Ray cluster to outlive this process: "
                         "--address auto (after `ray start --head`) or ray://HOST:10001")
    ray.init(address=options.address, namespace=NAMESPACE, log_to_driver=False)
    with contextlib.suppress(ValueError):
        door = ray.get_actor(frontdoor_name(name))
        return {**ray.get(door.ready.remote(ready_timeout_s)), "existing": True}
    # On the head, which lives as long as the Ray cluster: a front door restarted anywhere
    # finds it (the autoscaler may remove other idle nodes, Kubernetes restart other pods).
    Registry.options(name=registry_name(name), lifetime="detached", get_if_exists=True,
                     resources={HEAD_RESOURCE: 0.001}).remote()
    if FRONTDOOR_RESOURCE in ray.cluster_resources():
        placement: dict[str, Any] = {"resources": {FRONTDOOR_RESOURCE: 0.01}}
    else:
        node = ray.get_runtime_context().get_node_id()
        placement = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}
    door = FrontDoor.options(name=frontdoor_name(name), lifetime="detached",
                             max_restarts=-1, **placement).remote(options, name)
    try:
        return {**ray.get(door.ready.remote(ready_timeout_s)), "existing": False}
    except Exception:
        stop(options.address, name, drain_timeout_s=0)
        raise


def drain(address: str | None, name: str = DEFAULT_NAME,
          timeout_s: float | None = None) -> int | None:
    """Drain a detached cluster's front door in place and wait until it is drained
    (`FrontDoor.drain`); the workers go on, for the front door Ray starts next.

    Args:
        address: the Ray cluster (None: auto).
        name: the cluster's `--name`.
        timeout_s: how long running requests may take; None: the front door's own
            `--drain-timeout`.

    Returns:
        How many requests were still running at the timeout; None: no such cluster.

    Raises:
        ValueError: a negative `timeout_s`.
        RuntimeError: the front door does not serve (`FrontDoor.drain`).
    """
    if timeout_s is not None and timeout_s < 0:
        raise ValueError(f"--drain-timeout must be >= 0, got {timeout_s:g}")
    if not ray.is_initialized():
        ray.init(address=address or "auto", namespace=NAMESPACE, log_to_driver=False)
    try:
        door = ray.get_actor(frontdoor_name(name))
    except ValueError:
        return None
    try:
        return ray.get(door.drain.remote(timeout_s))
    except ray.exceptions.RayTaskError as e:
        raise RuntimeError(str(e.cause)) from None
    except ray.exceptions.RayActorError:
        raise RuntimeError("the front door died before it was drained") from None


def stop(address: str | None, name: str = DEFAULT_NAME,
         drain_timeout_s: float = DRAIN_TIMEOUT_S) -> int:
    """Drain and stop a detached cluster: its front door, workers and registry.

    Returns:
        How many actors were removed (0: no such cluster).
    """
    if not ray.is_initialized():
        ray.init(address=address or "auto", namespace=NAMESPACE, log_to_driver=False)
    removed = 0
    with contextlib.suppress(ValueError):
        door = ray.get_actor(frontdoor_name(name))
        with contextlib.suppress(Exception):
            ray.get(door.shutdown.remote(drain_timeout_s + 60), timeout=drain_timeout_s + 90)
        ray.kill(door, no_restart=True)
        removed += 1
    # Whatever the front door could not stop (it was down): workers, their groups, registry.
    for actor_name in ray.util.list_named_actors():
        if actor_name.startswith(worker_prefix(name)) or actor_name == registry_name(name):
            with contextlib.suppress(ValueError):
                ray.kill(ray.get_actor(actor_name), no_restart=True)
                removed += 1
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(ray.util.get_placement_group(actor_name))
    return removed
