"""`ClusterBackend`: the router's backend over Ray-managed prefill and decode pools.

Control plane through Ray (start, liveness, drain, stop); data plane through ZMQ: the
router PUSHes `protocol` commands to each worker and PULLs their steps, replies and stats.

A worker is dead only when Ray says its actor died (its process is gone); late stats make
it `slow`, never dead. A dead or drained worker's requests are placed again: a decode
request resumes on another decode worker from its prompt plus the tokens already
streamed, so the client's stream continues. A worker that joins the decode pool (started,
moved in from the prefill pool, or a replacement) takes running requests from the busier
ones the same way. A failed KV transfer is retried once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec
import ray
import zmq
import zmq.asyncio
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.metrics import resilience_metrics, transfer_metrics
from cluster.worker import STATS_INTERVAL_S, WorkerSpec
from protocol import (
    Abort,
    Command,
    Failed,
    Generate,
    Prefill,
    Rejected,
    Reply,
    Reserved,
    Role,
    Stats,
    Step,
    TokenRecord,
    decode_reply,
    encode,
)
from protocol.secure import ClusterKey, SocketGuard
from router.auth import is_loopback
from router.backend import Backend, GenerateRequest, ModelInfo, TokenDelta
from router.placement import Placement, PrefixIndex, WorkerLoad, place_request, spread_onto

log = logging.getLogger(__name__)
# The longest a worker may take to change its role once drained (it waits up to 10 s for
# its engine to let go of what the drain left, then closes one KV endpoint).
CHANGE_ROLE_TIMEOUT_S = 30.0
# Stats older than this many intervals mark a worker `slow` in status (never dead).
SLOW_AFTER_INTERVALS = 4
INTERNAL_AUTH = ("auto", "curve", "off")
# The least output a running request must have left to be moved onto a worker that joined
# the pool: a move costs the recompute of its context there and a step's wait.
MIN_TOKENS_LEFT_TO_MOVE = 32


@dataclass(frozen=True)
class ClusterConfig:
    """How the pools are built.

    Args:
        model: model name or path.
        mode: `disaggregated` (prefill + decode pools) or `colocated` (mixed workers).
        num_prefill: prefill workers (disaggregated).
        num_decode: decode workers, or mixed workers when colocated.
        transports: KV transports decode workers offer.
        host: address workers and the router bind and advertise; `auto` is each node's IP.
        num_cpus_per_worker: Ray CPUs per worker.
        num_gpus_per_worker: Ray GPUs per worker (fractional shares a GPU).
        torch_threads: intra-op threads per worker.
        local_prefill_threshold: uncached prompts this short are prefilled on the decode worker.
        reserve_timeout_s: how long a request may wait for decode KV to free up.
        drain_timeout_s: how long a drained worker's requests may take to finish before
            they are moved to other workers.
        migrate: place a dead or drained worker's requests again (else they end in error).
        internal_auth: security of the internal ZMQ sockets (router <-> workers, KV
            transfer): `curve` encrypts them and admits only holders of the cluster's key,
            `off` is plain TCP, `auto` is `curve` unless the internal host is loopback on a
            single-node Ray cluster.
        worker: engine settings shared by all workers (a WorkerSpec template).
    """

    model: str = "smollm2"
    mode: str = "disaggregated"
    num_prefill: int = 1
    num_decode: int = 1
    transports: tuple[str, ...] = ("shm", "zmq")
    host: str = "127.0.0.1"
    num_cpus_per_worker: float = 1.0
    num_gpus_per_worker: float = 0.0
    torch_threads: int | None = 1
    local_prefill_threshold: int = 256
    reserve_timeout_s: float = 60.0
    drain_timeout_s: float = 30.0
    migrate: bool = True
    internal_auth: str = "auto"
    worker: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in ("disaggregated", "colocated"):
            raise ValueError(f"mode must be disaggregated or colocated, got {self.mode!r}")
        if self.num_decode < 1:
            raise ValueError(f"num_decode must be >= 1, got {self.num_decode}")
        if self.num_prefill < 0:
            raise ValueError(f"num_prefill must be >= 0, got {self.num_prefill}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.internal_auth not in INTERNAL_AUTH:
            raise ValueError(f"internal_auth must be one of {INTERNAL_AUTH}, "
                             f"got {self.internal_auth!r}")


def resolve_host(host: str) -> str:
    """`auto` means this node's IP as Ray sees it (multi-node clusters)."""
    return ray.util.get_node_ip_address() if host == "auto" else host


def uses_curve(internal_auth: str, host: str) -> bool:
    """Whether the internal sockets run CURVE: always for `curve`; for `auto`, unless
    every socket is on loopback of a single-node Ray cluster (nobody else can connect,
    and encryption would only slow the zmq KV path).

    Args:
        internal_auth: `auto`, `curve` or `off`.
        host: the resolved internal host.
    """
    if internal_auth != "auto":
        return internal_auth == "curve"
    return not is_loopback(host) or sum(node["Alive"] for node in ray.nodes()) > 1


@ray.remote
class WorkerActor:
    """Ray owns the process; the `Worker` inside does the work on its own threads."""

    def __init__(self, spec: WorkerSpec) -> None:
        from dataclasses import replace

        from cluster.worker import Worker

        self.worker = Worker(replace(spec, host=resolve_host(spec.host)))

    def info(self) -> dict[str, Any]:
        return {**self.worker.info(), "node_id": ray.get_runtime_context().get_node_id()}

    def stats(self) -> dict[str, Any]:
        """A stats snapshot taken on the engine thread (waits for the current step)."""
        return self.worker.loop.call(self.worker.stats)

    def change_role(self, role: str) -> dict[str, Any]:
        """Prefill <-> decode in place (the worker must be idle); `info` in the new role."""
        self.worker.change_role(Role(role))
        return self.info()

    def wait_stopped(self) -> None:
        """Returns when the worker shuts down; raises (ActorDiedError) if it dies first."""
        self.worker.wait_stopped()

    def shutdown(self) -> None:
        self.worker.shutdown()


@dataclass
class _Handle:
    worker_id: str
    role: Role
    actor: Any
    pg: Any
    info: dict[str, Any]
    socket: zmq.asyncio.Socket
    stats: dict[str, Any] = field(default_factory=dict)
    stats_at: float = field(default_factory=time.monotonic)  # when stats last arrived
    state: str = "ready"  # ready | draining | dead
    stopping: bool = False  # we are stopping it: its end is not a death
    in_flight: set[str] = field(default_factory=set)
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def load(self) -> WorkerLoad:
        s = self.stats
        return WorkerLoad(self.worker_id, self.role,
                          num_free_blocks=s.get("num_free_blocks", self.info["num_blocks"]),
                          num_blocks=self.info["num_blocks"], num_running=s.get("num_running", 0),
                          num_waiting=s.get("num_waiting", 0),
                          queued_prefill_tokens=s.get("queued_prefill_tokens", 0),
                          in_flight=len(self.in_flight))

    def shown_state(self, now: float) -> str:
        """`slow` when a ready worker's stats are late (busy or stalled, but alive)."""
        late = now - self.stats_at > SLOW_AFTER_INTERVALS * STATS_INTERVAL_S
        return "slow" if self.state == "ready" and late else self.state

    def add(self, request_id: str) -> None:
        self.in_flight.add(request_id)
        self.idle.clear()

    def discard(self, request_id: str) -> None:
        self.in_flight.discard(request_id)
        if not self.in_flight:
            self.idle.set()


@dataclass
class _Stream:
    """One request's life in the cluster, across the attempts that serve it."""

    request: GenerateRequest
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    attempt: int = 0
    attempt_id: str = ""  # the request id the workers know (one per placement)
    generated: list[int] = field(default_factory=list)  # tokens streamed to the client
    reply: asyncio.Future | None = None
    decode: str | None = None
    prefill: str | None = None
    num_kv_blocks: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    transfer_retries: int = 0
    finished: bool = False


def _tokens_left(stream: _Stream) -> int:
    return stream.request.params.max_tokens - len(stream.generated)


def _movable(stream: _Stream, worker_id: str) -> bool:
    """Decoding on `worker_id` (a token streamed: no reservation can be pending, a placement
    after the first token prefills locally) with enough left, and not a seeded sample: a
    move restarts its random stream, so its tokens would differ from an undisturbed run's."""
    params = stream.request.params
    return (stream.decode == worker_id and bool(stream.generated) and not stream.finished
            and _tokens_left(stream) >= MIN_TOKENS_LEFT_TO_MOVE
            and (params.seed is None or params.temperature == 0))


class ClusterBackend(Backend):
    """Starts and owns the worker pools; places, streams and migrates requests.

    Args:
        config: pool layout and engine settings.
    """

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.workers: dict[str, _Handle] = {}
        self._streams: dict[str, _Stream] = {}  # by the client's request id
        self._attempts: dict[str, _Stream] = {}  # by the attempt id the workers know
        self._ids = itertools.count()
        self._prefix = PrefixIndex(config.worker.get("block_size", 16))
        self._tasks: set[asyncio.Task] = set()
        host = resolve_host(config.host)
        self.cluster_key = ClusterKey.generate() if uses_curve(config.internal_auth, host) \
            else None
        self.internal_security = ("CURVE (encrypted; only holders of the cluster key)"
                                  if self.cluster_key else "plain TCP (unauthenticated)")
        log.info("internal sockets on %s: %s", host, self.internal_security)
        self._ctx = zmq.asyncio.Context()
        self.sockets = SocketGuard(self._ctx, self.cluster_key)
        self._pull = self._ctx.socket(zmq.PULL)
        self.endpoint = self.sockets.bind(self._pull, f"tcp://{host}:0")
        self._model_info: ModelInfo | None = None
        self._starting = 0  # workers being started (a request may wait for one)
        self._worker_ready = asyncio.Event()  # set (and replaced) whenever one is ready
        self.transfer_registry, self.transfer_seconds, self.transfer_bytes = transfer_metrics()
        self.migrations, self.transfer_retries, self.spread_moves = resilience_metrics(
            self.transfer_registry)

    # ---- lifecycle ----

    async def start(self) -> None:
        """Start the pools and wait until every worker has loaded its model."""
        self._spawn(self._recv_loop())
        roles = [(Role.MIXED, self.config.num_decode)] if self.config.mode == "colocated" \
            else [(Role.DECODE, self.config.num_decode), (Role.PREFILL, self.config.num_prefill)]
        await asyncio.gather(*(self._add_worker(role) for role, n in roles for _ in range(n)))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(self._stop_worker(h) for h in list(self.workers.values())),
                             return_exceptions=True)
        self.sockets.close()
        self._ctx.destroy(linger=0)

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _add_worker(self, role: Role) -> _Handle:
        worker_id = f"{role}-{next(self._ids)}"
        spec = WorkerSpec(worker_id=worker_id, role=role, model=self.config.model,
                          router_endpoint=self.endpoint, host=self.config.host,
                          cluster_key=self.cluster_key,
                          transports=self.config.transports,
                          torch_threads=self.config.torch_threads, **self.config.worker)
        bundle = {"CPU": self.config.num_cpus_per_worker}
        if self.config.num_gpus_per_worker:
            bundle["GPU"] = self.config.num_gpus_per_worker
        pool_resource = f"pd_{'decode' if role.decodes else role}"
        if pool_resource in ray.cluster_resources():
            bundle[pool_resource] = 0.01
        self._starting += 1
        try:
            return await self._start_actor(worker_id, role, spec, bundle)
        finally:
            self._starting -= 1

    async def _start_actor(self, worker_id: str, role: Role, spec: WorkerSpec,
                           bundle: dict[str, float]) -> _Handle:
        pg = placement_group([bundle], strategy="STRICT_PACK")
        await pg.ready()
        actor = WorkerActor.options(
            num_cpus=self.config.num_cpus_per_worker, num_gpus=self.config.num_gpus_per_worker,
            resources={k: v for k, v in bundle.items() if k.startswith("pd_")},
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg),
            max_concurrency=8, name=f"pdcluster-{worker_id}-{time.time_ns()}",
        ).remote(spec)
        try:
            info = await actor.info.remote()
        except Exception:
            remove_placement_group(pg)
            raise
        socket = self._ctx.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 0)
        self.sockets.connect(socket, info["endpoint"])
        handle = _Handle(worker_id, role, actor, pg, info, socket)
        handle.idle.set()
        self.workers[worker_id] = handle
        self._spawn(self._watch(handle))
        if self._model_info is None:
            self._model_info = ModelInfo(self.config.model, info["model_dir"],
                                         info["max_model_len"], info["vocab_size"])
        log.info("worker %s ready at %s (pid %s)", worker_id, info["endpoint"], info["pid"])
        self._worker_ready.set()
        self._worker_ready = asyncio.Event()
        self._spread(handle)
        return handle

    async def _stop_worker(self, handle: _Handle) -> None:
        handle.stopping = True
        self.workers.pop(handle.worker_id, None)
        self._prefix.forget(handle.worker_id)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(handle.actor.shutdown.remote(), 10)
        with contextlib.suppress(Exception):
            ray.kill(handle.actor)
        with contextlib.suppress(Exception):
            remove_placement_group(handle.pg)
        handle.socket.close(linger=0)

    # ---- Backend ----

    def model_info(self) -> ModelInfo:
        if self._model_info is None:
            raise RuntimeError("the cluster has not started")
        return self._model_info

    def healthy(self) -> bool:
        return any(h.state == "ready" and h.role.decodes for h in self.workers.values())

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        stream = _Stream(request)
        self._streams[request.request_id] = stream
        try:
            try:
                await self._dispatch(stream)
            except RuntimeError as e:
                yield TokenDelta(request.request_id, [], "error", error=str(e))
                return
            while True:
                delta = await stream.queue.get()
                if delta.finish_reason is not None:
                    stream.finished = True
                    delta.timings.update(stream.timings)
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            self._streams.pop(request.request_id, None)
            self._attempts.pop(stream.attempt_id, None)
            if stream.reply is not None and not stream.reply.done():
                stream.reply.cancel()  # a migration waiting on a reservation gives up
            if not stream.finished:
                self._send_abort(stream)
            self._release(stream)

    async def abort(self, request_id: str) -> bool:
        stream = self._streams.get(request_id)
        if stream is None:
            return False
        self._send_abort(stream)
        return True

    async def status(self) -> dict[str, Any]:
        pools: dict[str, list[dict[str, Any]]] = {}
        now = time.monotonic()
        for h in self.workers.values():
            pools.setdefault(str(h.role), []).append(
                {**h.stats, "worker_id": h.worker_id, "role": str(h.role),
                 "state": h.shown_state(now), "node": h.info.get("node_id", ""),
                 "host": h.info.get("host", ""), "pid": h.info.get("pid", 0),
                 "stats_age_s": now - h.stats_at, "in_flight": len(h.in_flight)})
        return {"mode": self.config.mode, "model": self.config.model, "pools": pools,
                "num_streams": len(self._streams)}

    async def scale(self, num_prefill: int | None, num_decode: int | None) -> dict[str, Any]:
        """Add workers (returns once they are ready) or drain and remove some.

        A rebalance (one pool grows as the other shrinks) moves workers between the pools
        in place: each drains, then changes its role, keeping its process, model and KV
        pool, so no worker starts and no resources are needed beside the old. What is left
        to add or remove after that (and any worker that could not change) makes before it
        breaks: the new workers start, and only once they are ready do the old ones drain;
        when the cluster has no room for the new workers beside the old (Ray's available
        CPUs and GPUs), the old ones drain first to free theirs.
        """
        if self.config.mode == "colocated" and num_prefill:
            raise ValueError("prefill: a colocated cluster has no prefill pool")
        decode_role = Role.MIXED if self.config.mode == "colocated" else Role.DECODE
        if num_decode is not None and num_decode < 1:
            raise ValueError(f"decode: must be >= 1, got {num_decode}")
        if num_prefill is not None and num_prefill < 0:
            raise ValueError(f"prefill: must be >= 0, got {num_prefill}")
        change = {role: target - len(self._active(role))
                  for role, target in ((Role.PREFILL, num_prefill), (decode_role, num_decode))
                  if target is not None}
        await self._move(change)
        if self._has_room(sum(n for n in change.values() if n > 0)):
            await self._grow(change)
            self._shrink(change)
        else:
            self._shrink(change)
            await self._grow(change)
        return await self.status()

    async def _move(self, change: dict[Role, int]) -> None:
        """Turn workers of the shrinking pool into workers of the growing one, in place;
        `change` keeps what is left to start or stop."""
        if len(change) != 2 or Role.MIXED in change:
            return
        (role, n), (other, m) = change.items()
        if n * m >= 0:
            return
        source, target = (role, other) if n < 0 else (other, role)
        chosen = self._least_busy(source, min(abs(n), abs(m)))
        moved = await asyncio.gather(*(self._change_role(handle, target) for handle in chosen))
        change[source] += len(chosen)  # each left the pool: moved, or stopped if it failed
        change[target] -= sum(moved)

    async def _change_role(self, handle: _Handle, role: Role) -> bool:
        """Drain the worker, then change its role; False (and the worker stopped) if it
        could not."""
        await self._empty(handle)
        self._prefix.forget(handle.worker_id)
        try:
            info = await asyncio.wait_for(handle.actor.change_role.remote(str(role)),
                                          CHANGE_ROLE_TIMEOUT_S)
        except Exception as e:
            log.warning("worker %s could not become %s (%s); stopping it", handle.worker_id,
                        role, e)
            await self._stop_worker(handle)
            return False
        handle.role, handle.info, handle.state = role, info, "ready"
        log.info("worker %s is now %s", handle.worker_id, role)
        self._worker_ready.set()
        self._worker_ready = asyncio.Event()
        self._spread(handle)
        return True

    def _least_busy(self, role: Role, n: int) -> list[_Handle]:
        return sorted(self._active(role), key=lambda h: len(h.in_flight))[:n]

    def _active(self, role: Role) -> list[_Handle]:
        return [h for h in self.workers.values() if h.role == role and h.state == "ready"]

    def _has_room(self, workers: int) -> bool:
        """Whether Ray has the CPUs (and GPUs) for `workers` more workers now."""
        free = ray.available_resources()
        return (free.get("CPU", 0.0) >= workers * self.config.num_cpus_per_worker
                and free.get("GPU", 0.0) >= workers * self.config.num_gpus_per_worker)

    async def _grow(self, change: dict[Role, int]) -> None:
        await asyncio.gather(*(self._add_worker(role) for role, n in change.items()
                               for _ in range(n)))

    def _shrink(self, change: dict[Role, int]) -> None:
        """Drain the least busy workers of each pool that shrinks."""
        for role, n in change.items():
            if n < 0:
                for handle in self._least_busy(role, -n):
                    handle.state = "draining"
                    self._spawn(self._drain(handle))

    async def _drain(self, handle: _Handle) -> None:
        """Drain the worker (`_empty`), then stop it."""
        await self._empty(handle)
        await self._stop_worker(handle)

    async def _empty(self, handle: _Handle) -> None:
        """Stop placing on the worker; its requests finish (or, after the drain timeout,
        move to other workers)."""
        handle.state = "draining"
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(handle.idle.wait(), self.config.drain_timeout_s)
        self._evacuate(handle)

    # ---- placement and dispatch ----

    async def _dispatch(self, stream: _Stream, exclude: frozenset[str] = frozenset()) -> None:
        """Place the stream's next attempt on a live decode worker.

        A first attempt may prefill remotely; a migrated one (tokens already streamed) is
        recomputed on its decode worker, which counts those tokens as output, so penalties,
        the grammar and `max_tokens` continue exactly where the dead worker stopped.

        Raises:
            RuntimeError: no decode worker can take it (none alive, or no KV in time).
        """
        request = stream.request
        self._attempts.pop(stream.attempt_id, None)
        stream.attempt += 1
        stream.attempt_id = f"{request.request_id}@{stream.attempt}"
        self._attempts[stream.attempt_id] = stream
        prompt = request.prompt_token_ids
        generated = list(stream.generated)
        params = asdict(request.params)
        deadline = time.monotonic() + self.config.reserve_timeout_s
        while True:
            placement = self._place(prompt + generated, exclude, remote_prefill=not generated)
            if placement is None:
                await self._wait_for_worker(deadline)
                continue
            decode = self.workers[placement.decode_worker]
            stream.decode, stream.prefill = decode.worker_id, None
            decode.add(request.request_id)
            command = Generate(request_id=stream.attempt_id, prompt_token_ids=prompt,
                               params=params, remote_prefill=placement.prefill_worker is not None,
                               output_token_ids=generated)
            if not command.remote_prefill:
                await self._send(decode, command)
                return
            stream.reply = asyncio.get_running_loop().create_future()
            await self._send(decode, command)
            reply = await stream.reply
            if isinstance(reply, Reserved):
                self._start_prefill(stream, placement.prefill_worker, decode, reply, prompt,
                                    params)
                return
            decode.discard(request.request_id)
            if reply is None:  # the decode worker died before answering: place again
                continue
            if time.monotonic() > deadline:
                raise RuntimeError(f"no decode KV blocks freed up in time: {reply.reason}")
            await asyncio.sleep(0.05)

    async def _wait_for_worker(self, deadline: float) -> None:
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

    def _place(self, prompt: list[int], exclude: frozenset[str],
               remote_prefill: bool = True) -> Placement | None:
        ready = [h for h in self.workers.values() if h.state == "ready"
                 and h.worker_id not in exclude]
        decode = [h.load() for h in ready if h.role.decodes]
        prefill = [h.load() for h in ready if h.role == Role.PREFILL and remote_prefill]
        return place_request(self._prefix, prompt, decode, prefill,
                             self.config.local_prefill_threshold)

    def _start_prefill(self, stream: _Stream, prefill_id: str, decode: _Handle,
                       reply: Reserved, prompt: list[int], params: dict[str, Any]) -> None:
        prefill = self.workers.get(prefill_id)
        if prefill is None or prefill.state != "ready" or prefill.role != Role.PREFILL:
            # Gone, draining or changing its role since the placement: the decode worker
            # prefills instead.
            self._send_nowait(decode, Abort(request_id=stream.attempt_id))
            self._spawn(self._migrate(stream, "its prefill worker went away", count=False))
            return
        stream.prefill = prefill_id
        stream.num_kv_blocks = len(reply.dst_block_ids)
        prefill.add(stream.request.request_id)
        self._send_nowait(prefill, Prefill(
            request_id=stream.attempt_id, prompt_token_ids=prompt, params=params,
            peer_info=decode.info["peer_info"], dst_block_ids=reply.dst_block_ids,
            num_cached_tokens=reply.num_cached_tokens))

    async def _send(self, handle: _Handle, command: Command) -> None:
        await handle.socket.send(encode(command))

    def _send_nowait(self, handle: _Handle, command: Command) -> None:
        self._spawn(self._send(handle, command))

    def _send_abort(self, stream: _Stream) -> None:
        for worker_id in (stream.prefill, stream.decode):
            handle = self.workers.get(worker_id) if worker_id else None
            if handle is not None and handle.state != "dead":
                self._send_nowait(handle, Abort(request_id=stream.attempt_id))

    def _release(self, stream: _Stream, only_prefill: bool = False) -> None:
        """Drop the request from its workers' in-flight sets (what draining waits on)."""
        for worker_id in (stream.prefill,) if only_prefill else (stream.prefill, stream.decode):
            handle = self.workers.get(worker_id) if worker_id else None
            if handle is not None:
                handle.discard(stream.request.request_id)

    # ---- migration ----

    async def _migrate(self, stream: _Stream, why: str, exclude: frozenset[str] = frozenset(),
                       count: bool = True, level: int = logging.WARNING) -> None:
        """End the stream's current attempt and place it again; the client sees no seam."""
        self._send_abort(stream)
        self._release(stream)
        if stream.finished or self._streams.get(stream.request.request_id) is not stream:
            return
        if not self.config.migrate:
            stream.queue.put_nowait(TokenDelta(stream.request.request_id, [], "error",
                                               error=why))
            return
        log.log(level, "request %s placed again after %d tokens: %s",
                stream.request.request_id, len(stream.generated), why)
        if count:
            self.migrations.inc()
        try:
            await self._dispatch(stream, exclude)
        except RuntimeError as e:
            stream.queue.put_nowait(TokenDelta(stream.request.request_id, [], "error",
                                               error=f"{why}; placing it again failed: {e}"))

    def _spread(self, joined: _Handle) -> None:
        """Move running requests from the busier workers of the pool onto `joined`, which
        just joined it, until the pool's counts are even (`spread_onto`).

        Without this, the requests placed before the pool grew stay at the batch that made
        it grow until they finish. Each moves like a migration (`_migrate`): it is placed
        again away from its worker (onto `joined` unless another is less loaded), which
        recomputes its prompt and the tokens already streamed; the client's stream goes on.
        Only decoding requests move (`_movable`), those with the most output left first.
        """
        if not self.config.migrate or not joined.role.decodes:
            return
        counts = {h.worker_id: len(h.in_flight) for h in self._active(joined.role)}
        for source, n in spread_onto(counts, joined.worker_id).items():
            streams = (self._streams.get(rid) for rid in self.workers[source].in_flight)
            movable = sorted((s for s in streams if s is not None and _movable(s, source)),
                             key=_tokens_left, reverse=True)
            for stream in movable[:n]:
                self.spread_moves.inc()
                self._spawn(self._migrate(stream, f"moved to even the load as worker "
                                          f"{joined.worker_id} joined",
                                          frozenset({source}), count=False, level=logging.INFO))

    def _evacuate(self, handle: _Handle) -> None:
        """Move the requests a dead (or drained) worker still holds to other workers."""
        for rid in list(handle.in_flight):
            stream = self._streams.get(rid)
            if stream is None:
                continue
            if stream.reply is not None and not stream.reply.done() \
                    and stream.decode == handle.worker_id:
                stream.reply.set_result(None)  # `_dispatch` is waiting on it: it places again
            elif stream.decode == handle.worker_id or stream.prefill == handle.worker_id:
                self._spawn(self._migrate(stream, f"worker {handle.worker_id} went away"))

    # ---- inbound ----

    async def _recv_loop(self) -> None:
        while True:
            data = await self._pull.recv()
            try:
                message = decode_reply(data)
            except msgspec.DecodeError as e:  # a stray or corrupt message: drop it
                log.warning("dropped an undecodable worker message (%d bytes): %s",
                            len(data), e)
                continue
            try:
                self._on_message(message)
            except Exception:
                log.exception("bad message from %s", message.worker_id)

    def _on_message(self, message: Reply) -> None:
        handle = self.workers.get(message.worker_id)
        if handle is None:
            return
        if isinstance(message, Stats):
            handle.stats, handle.stats_at = message.stats, time.monotonic()
            return
        if isinstance(message, Step):
            for record in message.outputs:
                self._on_record(handle, record)
            return
        stream = self._attempts.get(message.request_id)
        if stream is None or message.worker_id not in (stream.decode, stream.prefill):
            if isinstance(message, Reserved):  # nobody waits for these blocks: free them
                self._send_nowait(handle, Abort(request_id=message.request_id))
            return  # about an attempt that was already replaced or ended
        if isinstance(message, Reserved | Rejected):
            if stream.reply is not None and not stream.reply.done():
                stream.reply.set_result(message)
        elif isinstance(message, Failed):
            if message.transfer_failed:
                self._retry_transfer(stream, message.error)
            else:
                self._fail(stream, message.error)

    def _on_record(self, handle: _Handle, record: TokenRecord) -> None:
        stream = self._attempts.get(record.request_id)
        if stream is None or stream.decode != handle.worker_id:
            return
        if record.timings:  # the remote prefill's KV landed: the prefill worker is done
            stream.timings.update(record.timings)
            self._count_transfer(stream, handle, record.timings)
            self._release(stream, only_prefill=True)
        if record.transfer_failed:
            self._retry_transfer(stream, record.error or "KV transfer failed")
            return
        stream.generated.extend(record.token_ids)
        stream.queue.put_nowait(TokenDelta(
            stream.request.request_id, record.token_ids, record.finish_reason, record.logprobs,
            record.num_cached_tokens, error=record.error))
        if record.finish_reason is not None:
            # The worker let go of it. Finished now, not when the client reads this: a move
            # or migration in between would start an attempt past its end.
            stream.finished = True

    def _retry_transfer(self, stream: _Stream, error: str) -> None:
        """Once per request: prefill again on another prefill worker, or locally."""
        if stream.transfer_retries:
            self._fail(stream, error)
            return
        stream.transfer_retries += 1
        self.transfer_retries.inc()
        exclude = frozenset({stream.prefill} if stream.prefill else ())
        self._spawn(self._migrate(stream, error, exclude, count=False))

    def _count_transfer(self, stream: _Stream, decode: _Handle,
                        timings: dict[str, float]) -> None:
        self.transfer_seconds.observe(timings.get("transfer", 0.0))
        self.transfer_bytes.inc(stream.num_kv_blocks * decode.info["block_bytes"])

    def _fail(self, stream: _Stream, error: str) -> None:
        if stream.reply is not None and not stream.reply.done():
            stream.reply.set_exception(RuntimeError(error))
        self._send_abort(stream)
        stream.queue.put_nowait(TokenDelta(stream.request.request_id, [], "error", error=error))

    # ---- liveness ----

    async def _watch(self, handle: _Handle) -> None:
        """Liveness from Ray: the call returns only when the actor stops or dies."""
        try:
            await handle.actor.wait_stopped.remote()
            error: Exception = RuntimeError("it stopped")
        except Exception as e:  # ActorDiedError and friends: the process is gone
            error = e
        if not handle.stopping and self.workers.get(handle.worker_id) is handle:
            await self._on_worker_death(handle, error)

    async def _on_worker_death(self, handle: _Handle, error: Exception) -> None:
        log.error("worker %s (pid %s) is gone: %s", handle.worker_id, handle.info.get("pid"),
                  str(error).splitlines()[0] if str(error) else type(error).__name__)
        if handle.state == "ready":  # a draining worker was leaving anyway
            # In the background, so the model load holds up nothing else; started before
            # the requests move, so they can wait for it when no other worker is left.
            self._spawn(self._replace(handle.role))
        handle.state = "dead"
        self._evacuate(handle)
        await self._stop_worker(handle)

    async def _replace(self, role: Role) -> None:
        try:
            await self._add_worker(role)
        except Exception:
            log.exception("could not replace a %s worker", role)


