"""The workers: Ray actors started and stopped, their sockets, their stats, their liveness.

Ray owns each worker's process (`WorkerActor`); requests and tokens never go through Ray:
the pool PUSHes `protocol` commands to each worker and PULLs their replies, steps and stats
on one socket. A worker is dead only when Ray says its actor died (its process is gone);
late stats make it `slow`, never dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import ray
import zmq
import zmq.asyncio
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config import ClusterConfig, resolve_host, uses_curve
from cluster.handle import WorkerHandle
from cluster.worker import WorkerSpec
from protocol import Command, Reply, Role, Stats, WorkerInfo, WorkerStats, decode_reply, encode
from protocol.secure import ClusterKey, SocketGuard

log = logging.getLogger(__name__)
# The longest a worker may take to change its role once drained (it waits up to 10 s for
# its engine to let go of what the drain left, then closes one KV endpoint).
CHANGE_ROLE_TIMEOUT_S = 30.0
# The longest a worker's shutdown may take before its actor is killed.
SHUTDOWN_TIMEOUT_S = 10.0
# How long one liveness call waits in the worker before it is made again.
WATCH_INTERVAL_S = 30.0


@ray.remote
class WorkerActor:
    """Ray owns the process; the `Worker` inside does the work on its own threads."""

    def __init__(self, spec: WorkerSpec) -> None:
        from cluster.worker import Worker

        self.worker = Worker(replace(spec, host=resolve_host(spec.host)))

    def info(self) -> WorkerInfo:
        return msgspec.structs.replace(self.worker.info(),
                                       node_id=ray.get_runtime_context().get_node_id())

    def stats(self) -> WorkerStats:
        """A stats snapshot taken on the engine thread (waits for the current step)."""
        return self.worker.loop.call(self.worker.stats)

    def change_role(self, role: str) -> WorkerInfo:
        """Prefill <-> decode in place (the worker must be idle); `info` in the new role."""
        self.worker.change_role(Role(role))
        return self.info()

    def adopt(self, router_endpoint: str) -> WorkerInfo:
        """Serve a restarted front door's router (its old requests end); `info`."""
        self.worker.adopt(router_endpoint)
        return self.info()

    def wait_stopped(self, timeout_s: float) -> bool:
        """Whether the worker shut down within `timeout_s`; raises (ActorDiedError) if it
        dies first. Bounded, so the call of a front door that died (`cluster.frontdoor`)
        frees its slot of the actor's threads."""
        return self.worker.wait_stopped(timeout_s)

    def shutdown(self) -> None:
        self.worker.shutdown()


@dataclass(frozen=True)
class Detached:
    """Workers that outlive the process that started them (`cluster.frontdoor`).

    Each worker is a detached Ray actor named `prefix + worker_id` (its placement group
    too), so a restarted front door finds and adopts the live ones instead of starting new
    workers.

    Args:
        prefix: the cluster's worker names, e.g. `pdcluster-worker-`.
        cluster_key: a restarted front door's: the key its workers already hold.
        restarted: adopt the live workers named `prefix*` (their `cluster_key` is the one
            above, not a new one).
    """

    prefix: str
    cluster_key: ClusterKey | None = None
    restarted: bool = False


WorkerCallback = Callable[[WorkerHandle], None]
DeathCallback = Callable[[WorkerHandle, BaseException], Coroutine[Any, Any, None]]
MessageCallback = Callable[[WorkerHandle, Reply], None]


class WorkerPool:
    """Starts, watches and stops the workers; owns the router's end of their sockets.

    Args:
        config: how workers are built.
        on_ready: called when a worker joins its pool (started or changed role).
        on_leave: called when a worker leaves its pool (stopped, or about to change role).
        on_death: awaited when Ray reports a worker died that the pool was not stopping.
        on_message: every reply but `Stats` (which the pool keeps on the worker's handle).
        detached: workers that outlive this process, adopted again after a restart; None:
            the workers end with this process.
    """

    def __init__(self, config: ClusterConfig, on_ready: WorkerCallback,
                 on_leave: WorkerCallback, on_death: DeathCallback,
                 on_message: MessageCallback, detached: Detached | None = None) -> None:
        self.config = config
        self.workers: dict[str, WorkerHandle] = {}
        self._on_ready, self._on_leave = on_ready, on_leave
        self._on_death, self._on_message = on_death, on_message
        self._ids = itertools.count()
        self._tasks: set[asyncio.Task] = set()
        host = resolve_host(config.host)
        self.detached = detached
        if detached is not None and detached.restarted:
            self.cluster_key = detached.cluster_key
        else:
            self.cluster_key = ClusterKey.generate() \
                if uses_curve(config.internal_auth, host) else None
        self.internal_security = ("CURVE (encrypted; only holders of the cluster key)"
                                  if self.cluster_key else "plain TCP (unauthenticated)")
        log.info("internal sockets on %s: %s", host, self.internal_security)
        self._ctx = zmq.asyncio.Context()
        self.sockets = SocketGuard(self._ctx, self.cluster_key)
        self._pull = self._ctx.socket(zmq.PULL)
        self.endpoint = self.sockets.bind(self._pull, f"tcp://{host}:0")
        self.first_info: WorkerInfo | None = None  # the first worker's, for model facts
        self._starting = 0  # workers being started (a request may wait for one)
        self._worker_ready = asyncio.Event()  # set (and replaced) whenever one is ready

    # ---- membership ----

    def active(self, role: Role) -> list[WorkerHandle]:
        """The workers of `role` taking new requests."""
        return [h for h in self.workers.values() if h.role == role and h.state == "ready"]

    def least_busy(self, role: Role, n: int) -> list[WorkerHandle]:
        """The `n` active workers of `role` with the fewest requests in flight."""
        return sorted(self.active(role), key=lambda h: len(h.in_flight))[:n]

    def has_room(self, change: dict[Role, int]) -> bool:
        """Whether Ray has the CPUs (and GPUs) now for the workers `change` adds per role."""
        free = ray.available_resources()
        need = {"CPU": 0.0, "GPU": 0.0}
        for role, n in change.items():
            spec = self.config.pool(role)
            need["CPU"] += max(n, 0) * spec.num_cpus
            need["GPU"] += max(n, 0) * spec.num_gpus
        return all(free.get(kind, 0.0) >= amount for kind, amount in need.items())

    async def wait_for_worker(self, deadline: float) -> None:
        """No decode worker is ready: wait for one being started (a replacement), if any.

        Raises:
            RuntimeError: none is being started, or none was ready by `deadline`.
        """
        if not self._starting:
            raise RuntimeError("no healthy decode worker")
        try:
            await asyncio.wait_for(self._worker_ready.wait(), deadline - time.monotonic())
        except TimeoutError:
            raise RuntimeError("no healthy decode worker (a replacement is starting)") from None

    def joined(self, handle: WorkerHandle) -> None:
        """The worker is ready in its (new) role: wake whoever waits, tell the owner."""
        self._worker_ready.set()
        self._worker_ready = asyncio.Event()
        self._on_ready(handle)

    # ---- start and stop ----

    def start(self) -> None:
        """Listen to the workers."""
        self._spawn(self._receive())

    async def add(self, role: Role) -> WorkerHandle:
        """Start one worker of `role` and return once it has loaded its model.

        The worker asks for a sliver of its pool's custom resource (`--prefill-resource`,
        `--decode-resource`; by default `pd_prefill` / `pd_decode` where a node offers
        them), so it lands only on a node labelled for that pool.

        Raises:
            RuntimeError: a named pool resource that no node of the Ray cluster offers.
        """
        worker_id = f"{role}-{next(self._ids)}"
        pool = self.config.pool(role)
        spec = WorkerSpec(worker_id=worker_id, role=role, model=self.config.model,
                          router_endpoint=self.endpoint, host=self.config.host,
                          cluster_key=self.cluster_key, transports=self.config.transports,
                          tracing=self.config.tracing, log=self.config.log, **pool.engine)
        bundle = {"CPU": pool.num_cpus}
        if pool.num_gpus:
            bundle["GPU"] = pool.num_gpus
        pool_resource, required = self.config.pool_resource(role.decodes)
        if pool_resource in ray.cluster_resources():
            bundle[pool_resource] = 0.01
        elif required:
            pool = "decode" if role.decodes else "prefill"
            raise RuntimeError(
                f"--{pool}-resource {pool_resource!r}: no node of the Ray cluster offers it; "
                f"start the {pool} nodes with ray start --resources "
                f"'{{\"{pool_resource}\": 8}}'")
        self._starting += 1
        try:
            return await self._start_actor(worker_id, role, spec, bundle)
        finally:
            self._starting -= 1

    async def _start_actor(self, worker_id: str, role: Role, spec: WorkerSpec,
                           bundle: dict[str, float]) -> WorkerHandle:
        if self.detached is None:
            name, lifetime = f"pdcluster-{worker_id}-{time.time_ns()}", None
        else:  # outlives this process: a restarted front door adopts it by its name
            name, lifetime = self.detached.prefix + worker_id, "detached"
        pg = placement_group([bundle], strategy="STRICT_PACK", name=name, lifetime=lifetime)
        await pg.ready()
        pool = self.config.pool(role)
        actor = WorkerActor.options(
            num_cpus=pool.num_cpus, num_gpus=pool.num_gpus,
            resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg),
            max_concurrency=8, name=name, lifetime=lifetime,
        ).remote(spec)
        try:
            info = await actor.info.remote()
        except Exception:
            with contextlib.suppress(Exception):
                ray.kill(actor)
            remove_placement_group(pg)
            raise
        return self._join(info, actor, pg)

    async def adopt(self) -> int:
        """After a restart: take over the live workers the old front door left (detached
        only). Each one ends the old router's requests and reports to this pool; one that
        cannot is stopped. New workers get ids after theirs.

        Returns:
            How many workers were adopted.
        """
        if self.detached is None or not self.detached.restarted:
            return 0
        prefix = self.detached.prefix
        names = sorted(n for n in ray.util.list_named_actors() if n.startswith(prefix))
        results = await asyncio.gather(*(self._adopt_one(name) for name in names),
                                       return_exceptions=True)
        ids = [int(n.rsplit("-", 1)[1]) for n in names if n.rsplit("-", 1)[1].isdigit()]
        self._ids = itertools.count(max(ids, default=-1) + 1)
        adopted = sum(isinstance(r, WorkerHandle) for r in results)
        log.info("adopted %d of the %d workers left by the previous front door", adopted,
                 len(names))
        return adopted

    async def _adopt_one(self, name: str) -> WorkerHandle:
        actor = ray.get_actor(name)
        pg = ray.util.get_placement_group(name)
        try:
            info = await actor.adopt.remote(self.endpoint)
        except Exception as e:
            log.warning("could not adopt worker %s (%s): stopping it", name, e)
            with contextlib.suppress(Exception):
                ray.kill(actor)
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
            raise
        return self._join(info, actor, pg)

    def _join(self, info: WorkerInfo, actor: Any, pg: Any) -> WorkerHandle:
        socket = self._ctx.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 0)
        self.sockets.connect(socket, info.endpoint)
        handle = WorkerHandle(info.worker_id, info.role, info, actor, pg, socket)
        self.workers[info.worker_id] = handle
        self._spawn(self._watch(handle))
        self.first_info = self.first_info or info
        log.info("worker %s ready at %s (pid %s)", info.worker_id, info.endpoint, info.pid)
        self.joined(handle)
        return handle

    async def change_role(self, handle: WorkerHandle, role: Role) -> None:
        """Turn an idle worker into one of `role` in place (same process, model, KV pool).

        Raises:
            Exception: the worker could not (then it keeps its old role and state).
        """
        self._on_leave(handle)
        info = await asyncio.wait_for(handle.actor.change_role.remote(str(role)),
                                      CHANGE_ROLE_TIMEOUT_S)
        handle.role, handle.info, handle.state = role, info, "ready"
        log.info("worker %s is now %s", handle.worker_id, role)
        self.joined(handle)

    async def stop(self, handle: WorkerHandle) -> None:
        """Stop the worker and forget it (its end is then not a death)."""
        handle.stopping = True
        self.workers.pop(handle.worker_id, None)
        self._on_leave(handle)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(handle.actor.shutdown.remote(), SHUTDOWN_TIMEOUT_S)
        with contextlib.suppress(Exception):
            ray.kill(handle.actor)
        with contextlib.suppress(Exception):
            remove_placement_group(handle.pg)
        handle.socket.close(linger=0)

    async def close(self) -> None:
        """Stop every worker and the sockets."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(self.stop(h) for h in list(self.workers.values())),
                             return_exceptions=True)
        self.sockets.close()
        self._ctx.destroy(linger=0)

    # ---- the data plane ----

    async def send(self, handle: WorkerHandle, command: Command) -> None:
        """Send one command to the worker."""
        await handle.socket.send(encode(command))

    async def _receive(self) -> None:
        while True:
            data = await self._pull.recv()
            try:
                message = decode_reply(data)
            except msgspec.DecodeError as e:  # a stray or corrupt message: drop it
                log.warning("dropped an undecodable worker message (%d bytes): %s",
                            len(data), e)
                continue
            handle = self.workers.get(message.worker_id)
            if handle is None:
                continue
            if isinstance(message, Stats):
                handle.stats, handle.stats_at = message.stats, time.monotonic()
                continue
            try:
                self._on_message(handle, message)
            except Exception:
                log.exception("bad message from %s", message.worker_id)

    # ---- liveness ----

    async def _watch(self, handle: WorkerHandle) -> None:
        """Liveness from Ray: the calls return True only when the actor stops, and fail
        when it dies."""
        try:
            while not await handle.actor.wait_stopped.remote(WATCH_INTERVAL_S):
                pass
            error: BaseException = RuntimeError("it stopped")
        except Exception as e:  # ActorDiedError and friends: the process is gone
            error = e
        if not handle.stopping and self.workers.get(handle.worker_id) is handle:
            log.error("worker %s (pid %s) is gone: %s", handle.worker_id,
                      handle.info.pid,
                      str(error).splitlines()[0] if str(error) else type(error).__name__)
            await self._on_death(handle, error)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
