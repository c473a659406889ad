"""`ClusterBackend`: the router's backend over Ray-managed prefill and decode pools.

Control plane through Ray (start, health, drain, stop); data plane through ZMQ: the router
PUSHes commands to each worker and PULLs their step messages, replies and stats.
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

import ray
import zmq
import zmq.asyncio
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.metrics import transfer_metrics
from cluster.worker import WorkerSpec, pack, unpack
from router.backend import Backend, GenerateRequest, ModelInfo, TokenDelta
from router.placement import PrefixIndex, WorkerLoad, place

log = logging.getLogger(__name__)


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
    worker: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in ("disaggregated", "colocated"):
            raise ValueError(f"mode must be disaggregated or colocated, got {self.mode!r}")
        if self.num_decode < 1:
            raise ValueError(f"num_decode must be >= 1, got {self.num_decode}")
        if self.num_prefill < 0:
            raise ValueError(f"num_prefill must be >= 0, got {self.num_prefill}")


def resolve_host(host: str) -> str:
    """`auto` means this node's IP as Ray sees it (multi-node clusters)."""
    return ray.util.get_node_ip_address() if host == "auto" else host


@ray.remote
class WorkerActor:
    """Ray owns the process; the `Worker` inside does the work on its own threads."""

    def __init__(self, spec: WorkerSpec) -> None:
        from dataclasses import replace

        from cluster.worker import Worker

        self.worker = Worker(replace(spec, host=resolve_host(spec.host)))

    def info(self) -> dict[str, Any]:
        return self.worker.info()

    def stats(self) -> dict[str, Any]:
        return self.worker.stats()

    def shutdown(self) -> None:
        self.worker.shutdown()


@dataclass
class _Handle:
    worker_id: str
    role: str
    actor: Any
    pg: Any
    info: dict[str, Any]
    socket: zmq.asyncio.Socket
    stats: dict[str, Any] = field(default_factory=dict)
    state: str = "ready"  # ready | draining | dead
    in_flight: set[str] = field(default_factory=set)

    def load(self) -> WorkerLoad:
        s = self.stats
        return WorkerLoad(self.worker_id, self.role,
                          num_free_blocks=s.get("num_free_blocks", self.info["num_blocks"]),
                          num_blocks=self.info["num_blocks"], num_running=s.get("num_running", 0),
                          num_waiting=s.get("num_waiting", 0),
                          queued_prefill_tokens=s.get("queued_prefill_tokens", 0),
                          in_flight=len(self.in_flight))


@dataclass
class _Stream:
    request: GenerateRequest
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    reply: asyncio.Future | None = None
    decode: str | None = None
    prefill: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    finished: bool = False


class ClusterBackend(Backend):
    """Starts and owns the worker pools; places and streams requests.

    Args:
        config: pool layout and engine settings.
    """

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.workers: dict[str, _Handle] = {}
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._prefix = PrefixIndex(config.worker.get("block_size", 16))
        self._tasks: list[asyncio.Task] = []
        self._sending: set[asyncio.Future] = set()
        self._ctx = zmq.asyncio.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(f"tcp://{resolve_host(config.host)}:0")
        self.endpoint = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self._model_info: ModelInfo | None = None
        self.transfer_registry, self.transfer_seconds, self.transfer_bytes = transfer_metrics()

    # ---- lifecycle ----

    async def start(self) -> None:
        """Start the pools and wait until every worker has loaded its model."""
        self._tasks.append(asyncio.create_task(self._recv_loop()))
        roles = [("mixed", self.config.num_decode)] if self.config.mode == "colocated" else \
            [("decode", self.config.num_decode), ("prefill", self.config.num_prefill)]
        await asyncio.gather(*(self._add_worker(role) for role, n in roles for _ in range(n)))
        self._tasks.append(asyncio.create_task(self._health_loop()))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*(self._stop_worker(h) for h in list(self.workers.values())),
                             return_exceptions=True)
        self._ctx.destroy(linger=0)

    async def _add_worker(self, role: str) -> _Handle:
        worker_id = f"{role}-{next(self._ids)}"
        spec = WorkerSpec(worker_id=worker_id, role=role, model=self.config.model,
                          router_endpoint=self.endpoint, host=self.config.host,
                          transports=self.config.transports,
                          torch_threads=self.config.torch_threads, **self.config.worker)
        bundle = {"CPU": self.config.num_cpus_per_worker}
        if self.config.num_gpus_per_worker:
            bundle["GPU"] = self.config.num_gpus_per_worker
        pool_resource = f"pd_{'decode' if role == 'mixed' else role}"
        if pool_resource in ray.cluster_resources():
            bundle[pool_resource] = 0.01
        pg = placement_group([bundle], strategy="STRICT_PACK")
        await pg.ready()
        actor = WorkerActor.options(
            num_cpus=self.config.num_cpus_per_worker, num_gpus=self.config.num_gpus_per_worker,
            resources={k: v for k, v in bundle.items() if k.startswith("pd_")},
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg),
            max_concurrency=4, name=f"pdcluster-{worker_id}-{time.time_ns()}",
        ).remote(spec)
        try:
            info = await actor.info.remote()
        except Exception:
            remove_placement_group(pg)
            raise
        socket = self._ctx.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(info["endpoint"])
        handle = _Handle(worker_id, role, actor, pg, info, socket)
        self.workers[worker_id] = handle
        if self._model_info is None:
            self._model_info = ModelInfo(self.config.model, info["model_dir"],
                                         info["max_model_len"], info["vocab_size"])
        log.info("worker %s ready at %s", worker_id, info["endpoint"])
        return handle

    async def _stop_worker(self, handle: _Handle) -> None:
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
        return any(h.state == "ready" and h.role in ("decode", "mixed")
                   for h in self.workers.values())

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
                if stream.finished:
                    return
        finally:
            self._streams.pop(request.request_id, None)
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
        for h in self.workers.values():
            pools.setdefault(h.role, []).append(
                {**h.stats, "worker_id": h.worker_id, "role": h.role, "state": h.state,
                 "in_flight": len(h.in_flight)})
        return {"mode": self.config.mode, "model": self.config.model, "pools": pools,
                "num_streams": len(self._streams)}

    async def scale(self, num_prefill: int | None, num_decode: int | None) -> dict[str, Any]:
        """Add workers (returns once they are ready) or drain and remove some."""
        if self.config.mode == "colocated" and num_prefill:
            raise ValueError("prefill: a colocated cluster has no prefill pool")
        decode_role = "mixed" if self.config.mode == "colocated" else "decode"
        if num_decode is not None and num_decode < 1:
            raise ValueError(f"decode: must be >= 1, got {num_decode}")
        for role, target in (("prefill", num_prefill), (decode_role, num_decode)):
            if target is not None:
                await self._resize(role, target)
        return await self.status()

    async def _resize(self, role: str, target: int) -> None:
        if target < 0:
            raise ValueError(f"{role}: must be >= 0, got {target}")
        active = [h for h in self.workers.values() if h.role == role and h.state == "ready"]
        if target > len(active):
            await asyncio.gather(*(self._add_worker(role)
                                   for _ in range(target - len(active))))
        for handle in sorted(active, key=lambda h: len(h.in_flight))[:len(active) - target]:
            handle.state = "draining"
            self._tasks.append(asyncio.create_task(self._drain(handle)))

    async def _drain(self, handle: _Handle) -> None:
        """Stop placing on the worker, wait for its requests to finish, then stop it."""
        while handle.in_flight:
            await asyncio.sleep(0.05)
        await self._stop_worker(handle)

    # ---- placement and dispatch ----

    async def _dispatch(self, stream: _Stream) -> None:
        request = stream.request
        deadline = time.monotonic() + self.config.reserve_timeout_s
        while True:
            placement = self._place(request)
            if placement is None:
                raise RuntimeError("no healthy decode worker")
            decode = self.workers[placement.decode_worker]
            stream.decode = decode.worker_id
            decode.in_flight.add(request.request_id)
            message = {"type": "generate", "request_id": request.request_id,
                       "prompt_token_ids": request.prompt_token_ids,
                       "params": _params_dict(request.params),
                       "remote_prefill": placement.prefill_worker is not None}
            if placement.prefill_worker is None:
                await decode.socket.send(pack(message))
                return
            stream.reply = asyncio.get_running_loop().create_future()
            await decode.socket.send(pack(message))
            reply = await stream.reply
            if reply["type"] == "reserved":
                await self._start_prefill(stream, placement.prefill_worker, decode, reply)
                return
            decode.in_flight.discard(request.request_id)
            if time.monotonic() > deadline:
                raise RuntimeError(f"no decode KV blocks freed up in time: {reply['reason']}")
            await asyncio.sleep(0.05)

    def _place(self, request: GenerateRequest) -> Any:
        ready = [h for h in self.workers.values() if h.state == "ready"]
        decode = [h.load() for h in ready if h.role in ("decode", "mixed")]
        prefill = [h.load() for h in ready if h.role == "prefill"]
        hashes = self._prefix.hashes(request.prompt_token_ids)
        d_owner, d_blocks = self._prefix.match(hashes, "decode")
        p_owner, _ = self._prefix.match(hashes, "prefill")
        placement = place(len(request.prompt_token_ids), decode, prefill,
                          d_blocks * self._prefix.block_size, d_owner, p_owner,
                          self.config.local_prefill_threshold)
        if placement is not None:
            self._prefix.record(hashes, "decode", placement.decode_worker)
            if placement.prefill_worker:
                self._prefix.record(hashes, "prefill", placement.prefill_worker)
        return placement

    async def _start_prefill(self, stream: _Stream, prefill_id: str, decode: _Handle,
                             reply: dict[str, Any]) -> None:
        request = stream.request
        prefill = self.workers.get(prefill_id)
        if prefill is None or prefill.state == "dead":
            await decode.socket.send(pack({"type": "abort", "request_id": request.request_id}))
            raise RuntimeError(f"prefill worker {prefill_id} went away")
        stream.prefill = prefill_id
        prefill.in_flight.add(request.request_id)
        await prefill.socket.send(pack({
            "type": "prefill", "request_id": request.request_id,
            "prompt_token_ids": request.prompt_token_ids,
            "params": _params_dict(request.params), "peer_info": decode.info["peer_info"],
            "dst_block_ids": reply["dst_block_ids"],
            "num_cached_tokens": reply["num_cached_tokens"]}))

    def _send_abort(self, stream: _Stream) -> None:
        message = pack({"type": "abort", "request_id": stream.request.request_id})
        for worker_id in (stream.prefill, stream.decode):
            handle = self.workers.get(worker_id) if worker_id else None
            if handle is not None and handle.state != "dead":
                sending = asyncio.ensure_future(handle.socket.send(message))
                self._sending.add(sending)
                sending.add_done_callback(self._sending.discard)

    def _release(self, stream: _Stream, only_prefill: bool = False) -> None:
        """Drop the request from its workers' in-flight sets (what draining waits on)."""
        for worker_id in (stream.prefill,) if only_prefill else (stream.prefill, stream.decode):
            handle = self.workers.get(worker_id) if worker_id else None
            if handle is not None:
                handle.in_flight.discard(stream.request.request_id)

    # ---- inbound ----

    async def _recv_loop(self) -> None:
        while True:
            message = unpack(await self._pull.recv())
            try:
                self._on_message(message)
            except Exception:
                log.exception("bad message from %s", message.get("worker_id"))

    def _on_message(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "stats":
            handle = self.workers.get(message["worker_id"])
            if handle is not None:
                handle.stats = message["stats"]
            return
        if kind == "step":
            for record in message["outputs"]:
                self._on_record(record)
            return
        stream = self._streams.get(message["request_id"])
        if stream is None:
            return
        if kind in ("reserved", "rejected") and stream.reply and not stream.reply.done():
            stream.reply.set_result(message)
        elif kind == "prefilled":
            stream.timings["prefill"] = message["prefill_s"]
        elif kind == "transferred":
            # Only now may a draining prefill worker stop: its KV has landed.
            stream.timings["transfer"] = message["transfer_s"]
            self._count_transfer(stream, message)
            self._release(stream, only_prefill=True)
        elif kind == "error":
            self._fail(stream, message["error"])

    def _on_record(self, record: dict[str, Any]) -> None:
        stream = self._streams.get(record["request_id"])
        if stream is None:
            return
        stream.queue.put_nowait(TokenDelta(
            record["request_id"], record["token_ids"], record["finish_reason"],
            record.get("logprobs"), record.get("num_cached_tokens", 0),
            error=record.get("error")))

    def _count_transfer(self, stream: _Stream, message: dict[str, Any]) -> None:
        decode = self.workers.get(stream.decode) if stream.decode else None
        self.transfer_seconds.observe(message["transfer_s"])
        if decode is not None:
            self.transfer_bytes.inc(message["num_blocks"] * decode.info["block_bytes"])

    def _fail(self, stream: _Stream, error: str) -> None:
        if stream.reply is not None and not stream.reply.done():
            stream.reply.set_exception(RuntimeError(error))
        self._send_abort(stream)
        stream.queue.put_nowait(TokenDelta(stream.request.request_id, [], "error", error=error))

    # ---- health ----

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            for handle in list(self.workers.values()):
                if handle.state == "dead":
                    continue
                try:
                    await asyncio.wait_for(handle.actor.stats.remote(), 5.0)
                except Exception as e:
                    await self._on_worker_death(handle, e)

    async def _on_worker_death(self, handle: _Handle, error: Exception) -> None:
        log.error("worker %s is gone (%s)", handle.worker_id, error)
        replace = handle.state == "ready"  # a draining worker was leaving anyway
        handle.state = "dead"
        for rid in list(handle.in_flight):
            stream = self._streams.get(rid)
            if stream is not None:
                self._fail(stream, f"worker {handle.worker_id} died")
        await self._stop_worker(handle)
        if replace:
            await self._add_worker(handle.role)


def _params_dict(params: Any) -> dict[str, Any]:
    return asdict(params)
