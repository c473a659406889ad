"""A worker process: one engine in one role at a time, its KV endpoint, and its ZMQ data plane.

Ray owns the process (`WorkerActor`); requests and token streams never go through Ray:
the router PUSHes `protocol` commands to the worker's PULL socket, and the worker PUSHes
one `Step` per engine step (plus replies and `Stats`) to the router's PULL socket.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import msgspec
import torch
import zmq

from decode_worker import DecodeRole
from engine import CacheConfig, EngineOutput, LLMEngine, SchedulerConfig, defaults
from engine.engine_loop import EngineLoop
from engine.hardware import measure_peaks
from kv_transfer import CompatRecord, KVReceiver, KVSender, SharedKVPool, TransferConfig
from prefill_worker import PrefillRole
from protocol import (
    Abort,
    Command,
    Failed,
    Reply,
    Role,
    Stats,
    Utilization,
    WorkerInfo,
    WorkerStats,
    decode_command,
    encode,
)
from protocol.defaults import STATS_INTERVAL_S
from protocol.logs import LogConfig, RequestTraces, configure_logging, request_log
from protocol.secure import ClusterKey, SocketGuard
from protocol.tracing import Tracer, TracingConfig
from protocol.worker_role import WorkerRole

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to start.

    Args:
        worker_id: unique name.
        role: `prefill`, `decode` or `mixed` (colocated).
        model: model name or path (see `engine.LLMEngine`).
        router_endpoint: the router's PULL socket, e.g. `tcp://10.0.0.1:5555`.
        host: address to bind and advertise.
        dtype: model dtype.
        num_blocks: KV blocks (None sizes by `kv_cache_memory_gb` or
            `gpu_memory_utilization`, `engine.config.kv_pool_bytes`).
        kv_cache_memory_gb: KV budget when `num_blocks` is None (None: the device's
            default).
        gpu_memory_utilization: on CUDA, the share of the GPU the worker may hold.
        block_size: tokens per block.
        max_num_batched_tokens: step token budget.
        max_num_seqs: most running requests.
        transports: KV transports a decode worker offers (`shm`, `zmq`, `torch_dist`,
            `mooncake`).
        torch_threads: intra-op threads for this worker.
        policy: `continuous` batching, or `static` (for comparison benchmarks).
        enable_prefix_caching: reuse cached prompt blocks.
        kv_cache_dtype: `auto` (the model's dtype) or `int8` KV pages; prefill and decode
            workers must agree (the KV handshake refuses a mismatch).
        kv_wait_timeout_s: how long reserved decode blocks wait for a remote prefill's KV
            (queueing on the prefill worker included; peer loss is detected sooner).
        max_model_len: longest prompt + output; None: the model's and the KV pool's limit.
        cluster_key: the cluster's CURVE keypair (handed out by the router through Ray):
            every socket of the worker and of its KV endpoint speaks CURVE and admits only
            holders of it; None: plain TCP.
        mooncake_protocol: the mooncake transport's `tcp`, `rdma` or `auto` (rdma where
            the node has an RDMA device).
        tracing: where the worker exports its spans (`prefill`, `kv_transfer`, `decode`);
            None: no tracing.
        speculative_config: `--speculative-config` (decode and mixed workers).
        log: the level and format of the worker process's log (`serve --log-level`,
            `--log-format`); None leaves the process's logging as it is (a worker that
            shares its process).
        tensor_parallel_size: ranks the worker's model is split over (`engine.parallel`):
            this process is rank 0, the others its child processes; a rank that dies ends
            the whole worker, whose requests then move as for any dead worker.
        tp_kv_pages: where its ranks keep their KV heads (`LLMEngine`'s `tp_kv_pages`):
            `auto` (shared memory on CPU, each rank's own device on GPU), `shared`,
            `private`.
    """

    worker_id: str
    role: Role
    model: str
    router_endpoint: str
    host: str = "127.0.0.1"
    dtype: str = defaults.DTYPE
    num_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float | None = None
    block_size: int = defaults.BLOCK_SIZE
    max_num_batched_tokens: int = defaults.MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = defaults.MAX_NUM_SEQS
    transports: tuple[str, ...] = ("shm", "zmq")
    torch_threads: int | None = None
    policy: str = "continuous"
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    kv_wait_timeout_s: float = 600.0
    max_model_len: int | None = None
    cluster_key: ClusterKey | None = None
    mooncake_protocol: str = "auto"
    tracing: TracingConfig | None = None
    speculative_config: str | None = None
    log: LogConfig | None = None
    tensor_parallel_size: int = 1
    tp_kv_pages: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))  # ValueError names a bad role


class Worker:
    """The worker's threads: engine loop, command reader, transfer events, stats clock.

    Only the engine loop's thread touches the engine: commands, transfer events and the
    stats snapshot are all submitted to it.

    Args:
        spec: what to run.
    """

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.started = time.monotonic()
        # Every record about a request gets its trace id (`protocol.logs`).
        self.traces = RequestTraces()
        if spec.log is not None:
            configure_logging(spec.log.level, spec.log.format, filters=[self.traces])
        self._lock = threading.Lock()
        self._ctx = zmq.Context()
        self._sockets = SocketGuard(self._ctx, spec.cluster_key)
        self._out = self._ctx.socket(zmq.PUSH)
        self._out.setsockopt(zmq.LINGER, 0)
        self._sockets.connect(self._out, spec.router_endpoint)
        self._cmd = self._ctx.socket(zmq.PULL)
        self.endpoint = self._sockets.bind(self._cmd, f"tcp://{spec.host}:0")
        self.engine = self._build_engine()
        self.peaks = measure_peaks(self.engine.device, self.engine.dtype, size=512, read_mb=64)
        self.utilization: Utilization | None = None
        self._last_sample: tuple[float, ...] | None = None
        self.tracer = Tracer(spec.tracing, str(spec.role), spec.worker_id)
        self.role = self._build_role()
        self.loop = EngineLoop(self.engine, self._on_outputs, self.role.layer_hook,
                               on_dead=self._die)
        self._stop = threading.Event()
        self.loop.start()
        self._threads = [threading.Thread(target=target, daemon=True, name=target.__name__)
                         for target in (self._read_commands, self._tick_stats)]
        for thread in self._threads:
            thread.start()
        self._start_pump()

    def _build_engine(self) -> LLMEngine:
        spec = self.spec
        # Prefill workers' pools are shared too, so either role can later receive over shm.
        self.shm_pool = SharedKVPool(f"pdcluster-{spec.worker_id}") \
            if spec.role != Role.MIXED and "shm" in spec.transports else None
        return LLMEngine(
            spec.model, spec.dtype,
            cache=CacheConfig(block_size=spec.block_size, num_blocks=spec.num_blocks,
                              kv_cache_memory_gb=spec.kv_cache_memory_gb,
                              gpu_memory_utilization=spec.gpu_memory_utilization,
                              enable_prefix_caching=spec.enable_prefix_caching,
                              kv_cache_dtype=spec.kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_batched_tokens=spec.max_num_batched_tokens,
                                      max_num_seqs=spec.max_num_seqs, role=str(spec.role),
                                      policy=spec.policy),
            num_threads=spec.torch_threads, kv_allocator=self.shm_pool,
            max_model_len=spec.max_model_len, speculative_config=spec.speculative_config,
            tensor_parallel_size=spec.tensor_parallel_size, tp_kv_pages=spec.tp_kv_pages)

    def _die(self, error: BaseException) -> None:
        """The engine can compute no more (a tensor-parallel rank died): end this process,
        as a lost worker ends, so the router moves its requests (their failed step's
        outputs are not sent: they would end the requests instead)."""
        log.critical("worker %s: engine dead (%s); exiting so its requests move",
                     self.spec.worker_id, error)
        self.engine.close()
        logging.shutdown()
        os._exit(1)

    def _build_role(self) -> WorkerRole:
        spec = self.spec
        if spec.role != Role.MIXED and not self.engine.kv_cache_whole:
            raise ValueError(
                f"a {spec.role} worker moves KV blocks, and its pool does not hold every KV "
                f"head at tensor-parallel-size {spec.tensor_parallel_size} on "
                f"{self.engine.device.type} (cluster.serve.check_tensor_parallel_sizes)")
        compat = CompatRecord.from_kv_cache(self.engine.kv_cache, str(self.engine.model_dir))
        config = TransferConfig(transports=spec.transports, host=spec.host,
                                cluster_key=spec.cluster_key,
                                mooncake_protocol=spec.mooncake_protocol)
        if spec.role == Role.PREFILL:
            return PrefillRole(spec.worker_id, self.engine,
                               KVSender(self.engine.kv_cache, compat, config), self.tracer)
        receiver = KVReceiver(self.engine.kv_cache, compat, config, self.shm_pool) \
            if spec.role == Role.DECODE else None
        return DecodeRole(spec.worker_id, self.engine, receiver, spec.kv_wait_timeout_s,
                          self.tracer)

    # ---- outbound ----

    def send(self, replies: list[Reply]) -> None:
        """Push replies to the router (from any thread)."""
        for reply in replies:
            data = encode(reply)
            with self._lock:
                self._out.send(data)

    def _on_outputs(self, outputs: list[EngineOutput]) -> None:
        self.send(self.role.on_outputs(outputs))

    # ---- inbound ----

    def _read_commands(self) -> None:
        while not self._stop.is_set():
            if not self._cmd.poll(200):
                continue
            data = self._cmd.recv()
            try:
                command = decode_command(data)
            except msgspec.DecodeError as e:  # a stray or corrupt message: drop it
                log.warning("dropped an undecodable command (%d bytes): %s", len(data), e)
                continue
            try:
                self._apply(command)
            except Exception as e:  # a bad command must not kill the reader
                self._fail(command, f"{type(e).__name__}: {e}")

    def _apply(self, command: Command) -> None:
        if isinstance(command, Abort):
            self.loop.submit(lambda e: self.send(self.role.abort(e, command.request_id)))
            return
        self.role.prepare(command)  # may block on the network: not on the engine thread
        self.loop.submit(self._guard(command))

    def _guard(self, command: Command) -> Any:
        """Run a command on the engine; a failure answers the request instead of vanishing."""
        def run(engine: LLMEngine) -> None:
            self.traces.add(command.request_id, getattr(command, "traceparent", None))
            try:
                self.send(self.role.handle(engine, command))
            except Exception as e:
                self._fail(command, f"{type(e).__name__}: {e}")
        return run

    def _fail(self, command: Command, error: str) -> None:
        """Answer a command that failed here (called where it raised)."""
        log.error("%s failed: %s", type(command).__name__, error, exc_info=True,
                  extra=request_log(command.request_id, getattr(command, "traceparent", None)))
        self.send([Failed(worker_id=self.spec.worker_id, request_id=command.request_id,
                          error=error)])

    def _start_pump(self) -> None:
        """Hand the role's transfer events to the engine thread, until the role changes."""
        role = self.role
        if role.endpoint is None:
            return
        thread = threading.Thread(target=self._pump_events, args=(role,), daemon=True,
                                  name="_pump_events")
        self._threads.append(thread)
        thread.start()

    def _pump_events(self, role: WorkerRole) -> None:
        while not self._stop.is_set() and self.role is role:
            events = role.endpoint.wait_events(timeout_s=0.2)
            if events:
                self.loop.submit(lambda e, ev=events: self.send(role.on_events(e, ev)))

    def change_role(self, role: Role, timeout_s: float = 10.0) -> None:
        """Become a prefill or a decode worker in place, keeping the process, the model and
        the KV pool (and what its prefix cache holds): a rebalance without a cold start.

        The router drains the worker first; what its engine still holds then (an abort on
        its way, a shipped prompt's KV about to be released) may take `timeout_s` to end.
        The old KV endpoint closes, so peers connected to it see it leave.

        Raises:
            ValueError: a colocated worker or role, or requests still in the engine after
                `timeout_s`.
        """
        role = Role(role)
        if Role.MIXED in (role, self.spec.role):
            raise ValueError("only a prefill and a decode worker can trade roles")

        def switch(engine: LLMEngine) -> bool:
            try:
                engine.set_role(str(role))
            except ValueError:
                return False  # it still holds requests
            old_spec, old, old_tracer = self.spec, self.role, self.tracer
            self.spec = replace(old_spec, role=role)
            self.tracer = Tracer(old_spec.tracing, str(role), old_spec.worker_id)
            try:
                self.role = self._build_role()
            except Exception:
                self.tracer.shutdown()
                self.spec, self.tracer = old_spec, old_tracer
                engine.set_role(str(old_spec.role))
                raise
            self.loop.layer_hook = self.role.layer_hook
            if old.endpoint is not None:
                old.endpoint.close()
            old_tracer.shutdown()
            return True
        if role == self.spec.role:
            return
        deadline = time.monotonic() + timeout_s
        while not self.loop.call(switch):
            if time.monotonic() > deadline:
                raise ValueError(f"still holds requests after {timeout_s:g}s; not changed")
            time.sleep(0.05)
        self._threads = [t for t in self._threads if t.is_alive()]
        self._start_pump()

    # ---- control ----

    def stats(self, engine: LLMEngine) -> WorkerStats:
        """Load, memory and utilization figures; call on the engine thread only."""
        return WorkerStats(
            **asdict(engine.stats()), busy_seconds=self.loop.busy_seconds,
            uptime_s=time.monotonic() - self.started, num_steps=self.loop.num_steps,
            step_totals={k: list(v) for k, v in self.loop.step_totals.items()},
            transfer_wait_seconds=self.loop.transfer_wait_seconds,
            peak_flops=self.peaks["flops"], peak_bandwidth=self.peaks["bandwidth"],
            utilization=self.utilization, **asdict(self.role.load(engine)))

    def _tick_stats(self) -> None:
        """Every interval, ask the engine thread for a snapshot and push it.

        A busy or stalled engine thread makes the stats late (the router shows the worker
        as `slow`), never wrong and never a reason to declare the worker dead.
        """
        while not self._stop.wait(STATS_INTERVAL_S):
            self.loop.submit(self._push_stats)

    def _push_stats(self, engine: LLMEngine) -> None:
        self.traces.keep(set(engine.requests) | self.role.pending())
        self._sample_utilization(engine)
        self.send([Stats(worker_id=self.spec.worker_id, stats=self.stats(engine))])

    def _sample_utilization(self, engine: LLMEngine) -> None:
        """Where the last interval went: compute (and how well), KV waits, idle."""
        counters = engine.runner.counters
        sample = (time.monotonic(), self.loop.busy_seconds, self.loop.transfer_wait_seconds,
                  counters["flops"], counters["bytes"])
        last, self._last_sample = self._last_sample, sample
        if last is None:
            return
        dt = max(sample[0] - last[0], 1e-9)
        busy, wait, flops, nbytes = ((now - then) / dt for now, then in
                                     zip(sample[1:], last[1:], strict=True))
        self.utilization = Utilization(
            busy=busy, idle=max(1.0 - busy - wait, 0.0), transfer_wait=wait,
            flops_utilization=flops / self.peaks["flops"],
            bandwidth_utilization=nbytes / self.peaks["bandwidth"])

    def info(self) -> WorkerInfo:
        """What the router needs: endpoints, role, model facts, KV peer info, pid."""
        cfg = self.engine.model_config
        receiver = self.role.endpoint if self.spec.role == Role.DECODE else None
        return WorkerInfo(
            worker_id=self.spec.worker_id, role=self.spec.role, endpoint=self.endpoint,
            host=self.spec.host, pid=os.getpid(), model_dir=str(self.engine.model_dir),
            max_model_len=self.engine.max_model_len, vocab_size=cfg.vocab_size,
            block_size=self.spec.block_size, num_blocks=self.engine.block_pool.num_blocks,
            block_bytes=self.engine.kv_cache.block_bytes * cfg.num_layers,
            torch_threads=torch.get_num_threads(),
            tensor_parallel_size=self.engine.tensor_parallel_size,
            rank_pids=self.engine.follower_pids,
            peer_info=receiver.peer_info() if receiver is not None else None)

    def adopt(self, router_endpoint: str) -> None:
        """Serve a new router (a restarted front door, `cluster.frontdoor`): replies go to
        `router_endpoint` from now on, and every request of the old router ends here, its
        KV freed (at once, or once its transfer stopped), since nobody waits for it."""
        out = self._ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 0)
        self._sockets.connect(out, router_endpoint)
        with self._lock:
            old, self._out = self._out, out
            self.spec = replace(self.spec, router_endpoint=router_endpoint)
        old.close(linger=0)

        def abort_all(engine: LLMEngine) -> int:
            request_ids = set(engine.requests) | self.role.pending()
            for request_id in request_ids:
                log.info("ended: its front door was replaced", extra=request_log(request_id))
                self.role.abort(engine, request_id)  # its replies were for the old router
            return len(request_ids)
        aborted = self.loop.call(abort_all)
        log.info("adopted by the router at %s; ended %d requests of the old one",
                 router_endpoint, aborted)

    def wait_stopped(self, timeout_s: float | None = None) -> bool:
        """Block until `shutdown` or for `timeout_s`; whether it shut down (Ray's liveness
        watch calls this)."""
        return self._stop.wait(timeout_s)

    def shutdown(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)
        self.loop.stop()
        if self.role.endpoint is not None:
            self.role.endpoint.close()
        self.tracer.shutdown()
        self._sockets.close()
        self._ctx.destroy(linger=0)
