"""A worker process: one engine in one role, its KV endpoint, and its ZMQ data plane.

Ray owns the process (`WorkerActor`); requests and token streams never go through Ray:
the router PUSHes msgpack commands to the worker's PULL socket, and the worker PUSHes one
message per engine step (plus replies and stats) to the router's PULL socket.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import msgpack
import torch
import zmq

from decode_worker import DecodeRole
from decode_worker.role import output_record
from engine import CacheConfig, EngineOutput, LLMEngine, SchedulerConfig
from engine.engine_loop import EngineLoop
from engine.hardware import measure_peaks
from kv_transfer import CompatRecord, KVReceiver, KVSender, SharedKVPool, TransferConfig
from prefill_worker import PrefillRole

log = logging.getLogger(__name__)
_STATS_INTERVAL_S = 0.5


def pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message)


def unpack(data: bytes) -> dict[str, Any]:
    return msgpack.unpackb(data, strict_map_key=False)


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
        num_blocks: KV blocks (None sizes by `kv_cache_memory_gb`).
        kv_cache_memory_gb: KV budget when `num_blocks` is None.
        block_size: tokens per block.
        max_num_batched_tokens: step token budget.
        max_num_seqs: most running requests.
        transports: KV transports a decode worker offers (`shm`, `zmq`, `torch_dist`).
        torch_threads: intra-op threads for this worker.
        policy: `continuous` batching, or `static` (for comparison benchmarks).
        enable_prefix_caching: reuse cached prompt blocks.
        kv_wait_timeout_s: how long reserved decode blocks wait for a remote prefill's KV
            (queueing on the prefill worker included; peer loss is detected sooner).
        max_model_len: longest prompt + output; None: the model's and the KV pool's limit.
    """

    worker_id: str
    role: str
    model: str
    router_endpoint: str
    host: str = "127.0.0.1"
    dtype: str = "float32"
    num_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    transports: tuple[str, ...] = ("shm", "zmq")
    torch_threads: int | None = None
    policy: str = "continuous"
    enable_prefix_caching: bool = True
    kv_wait_timeout_s: float = 600.0
    max_model_len: int | None = None


class Worker:
    """The worker's threads: engine loop, command reader, transfer events, stats.

    Args:
        spec: what to run.
    """

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._ctx = zmq.Context()
        self._out = self._ctx.socket(zmq.PUSH)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.connect(spec.router_endpoint)
        self._cmd = self._ctx.socket(zmq.PULL)
        self._cmd.bind(f"tcp://{spec.host}:0")
        self.endpoint = self._cmd.getsockopt_string(zmq.LAST_ENDPOINT)
        self.engine = self._build_engine()
        self.peaks = measure_peaks(self.engine.device, self.engine.dtype, size=512, read_mb=64)
        self.utilization: dict[str, float] = {}
        self._last_sample: tuple[float, ...] | None = None
        self._build_role()
        self.loop = EngineLoop(self.engine, self._on_outputs, self._layer_hook)
        self._stop = threading.Event()
        self.loop.start()
        self._threads = [threading.Thread(target=target, daemon=True, name=target.__name__)
                         for target in (self._read_commands, self._pump_events, self._push_stats)]
        for thread in self._threads:
            thread.start()

    def _build_engine(self) -> LLMEngine:
        spec = self.spec
        engine_role = {"prefill": "prefill", "decode": "decode"}.get(spec.role, "mixed")
        self.shm_pool = SharedKVPool(f"pdcluster-{spec.worker_id}") \
            if spec.role == "decode" and "shm" in spec.transports else None
        return LLMEngine(
            spec.model, spec.dtype,
            cache=CacheConfig(block_size=spec.block_size, num_blocks=spec.num_blocks,
                              kv_cache_memory_gb=spec.kv_cache_memory_gb,
                              enable_prefix_caching=spec.enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_batched_tokens=spec.max_num_batched_tokens,
                                      max_num_seqs=spec.max_num_seqs, role=engine_role,
                                      policy=spec.policy),
            num_threads=spec.torch_threads, kv_allocator=self.shm_pool,
            max_model_len=spec.max_model_len)

    def _build_role(self) -> None:
        spec = self.spec
        compat = CompatRecord.from_kv_cache(self.engine.kv_cache, str(self.engine.model_dir))
        config = TransferConfig(transports=spec.transports, host=spec.host)
        self.receiver = self.sender = None
        self.prefill = self.decode = None
        if spec.role == "prefill":
            self.sender = KVSender(self.engine.kv_cache, compat, config)
            self.prefill = PrefillRole(self.engine, self.sender)
        else:
            if spec.role == "decode":
                self.receiver = KVReceiver(self.engine.kv_cache, compat, config, self.shm_pool)
            self.decode = DecodeRole(self.engine, self.receiver, spec.kv_wait_timeout_s)

    # ---- outbound ----

    def send(self, message: dict[str, Any]) -> None:
        message["worker_id"] = self.spec.worker_id
        data = pack(message)
        with self._lock:
            self._out.send(data)

    def _on_outputs(self, outputs: list[EngineOutput]) -> None:
        if self.prefill is not None:
            for message in self.prefill.on_outputs(outputs):
                self.send(message)
            return
        self.send({"type": "step", "outputs": [output_record(o) for o in outputs]})

    def _layer_hook(self, layer: int, schedule: Any) -> None:
        if self.prefill is not None:
            self.prefill.layer_hook(layer, schedule)

    # ---- inbound ----

    def _read_commands(self) -> None:
        while not self._stop.is_set():
            if not self._cmd.poll(200):
                continue
            message = unpack(self._cmd.recv())
            try:
                self._dispatch(message)
            except Exception as e:  # a bad message must not kill the reader
                log.exception("command %s failed", message.get("type"))
                self._fail(message.get("request_id"), f"{type(e).__name__}: {e}")

    def _dispatch(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "prefill" and self.prefill is not None:
            # The handshake may block on the network: do it here, not on the engine thread.
            peer_id = self.prefill.connect(message["peer_info"])
            self.loop.submit(self._guard(message, lambda e: self.prefill.start(e, message,
                                                                               peer_id)))
        elif kind == "generate" and self.decode is not None:
            self.loop.submit(self._guard(message, lambda e: self._generate(e, message)))
        elif kind == "abort":
            self.loop.submit(lambda e: self._abort(e, message["request_id"]))
        else:
            raise ValueError(f"{self.spec.role} worker cannot handle {kind!r}")

    def _guard(self, message: dict[str, Any], command: Any) -> Any:
        """Run an engine command; a failure answers the request instead of vanishing."""
        def run(engine: LLMEngine) -> None:
            try:
                command(engine)
            except Exception as e:
                self._fail(message.get("request_id"), f"{type(e).__name__}: {e}")
        return run

    def _generate(self, engine: LLMEngine, message: dict[str, Any]) -> None:
        reply = self.decode.generate(engine, message)
        if reply is not None:
            self.send(reply)

    def _abort(self, engine: LLMEngine, request_id: str) -> None:
        if self.prefill is not None:
            self.prefill.abort(engine, request_id)
            return
        record = self.decode.abort(engine, request_id)
        if record is not None:
            self.send({"type": "step", "outputs": [record]})

    def _fail(self, request_id: str | None, error: str) -> None:
        if request_id is not None:
            self.send({"type": "error", "request_id": request_id, "error": error})

    def _pump_events(self) -> None:
        endpoint = self.sender or self.receiver
        if endpoint is None:
            return
        while not self._stop.is_set():
            events = endpoint.wait_events(timeout_s=0.2)
            if events:
                self.loop.submit(lambda e, ev=events: self._handle_events(e, ev))

    def _handle_events(self, engine: LLMEngine, events: list[Any]) -> None:
        if self.prefill is not None:
            for message in self.prefill.on_events(engine, events):
                self.send(message)
            return
        records = self.decode.on_events(engine, events)
        if records:
            self.send({"type": "step", "outputs": records})

    # ---- control ----

    def stats(self) -> dict[str, Any]:
        """Load, memory and utilization figures (also pushed every half second)."""
        stats = dict(self.engine.stats())
        uptime = time.monotonic() - self.started
        stats.update(worker_id=self.spec.worker_id, role=self.spec.role,
                     busy_seconds=self.loop.busy_seconds, uptime_s=uptime,
                     num_steps=self.loop.num_steps,
                     pid=os.getpid(), transfer_wait_seconds=self.loop.transfer_wait_seconds,
                     peak_flops=self.peaks["flops"], peak_bandwidth=self.peaks["bandwidth"],
                     utilization=self.utilization)
        if self.prefill is not None:
            stats.update(self.prefill.load())
        return stats

    def _push_stats(self) -> None:
        while not self._stop.wait(_STATS_INTERVAL_S):
            self._sample_utilization()
            self.send({"type": "stats", "stats": self.stats()})

    def _sample_utilization(self) -> None:
        """Where the last interval went: compute (and how well), KV waits, idle."""
        counters = self.engine.runner.counters
        sample = (time.monotonic(), self.loop.busy_seconds, self.loop.transfer_wait_seconds,
                  counters["flops"], counters["bytes"])
        last, self._last_sample = self._last_sample, sample
        if last is None:
            return
        dt = max(sample[0] - last[0], 1e-9)
        busy, wait, flops, nbytes = ((now - then) / dt for now, then in
                                     zip(sample[1:], last[1:], strict=True))
        self.utilization = {
            "busy": busy, "idle": max(1.0 - busy - wait, 0.0), "transfer_wait": wait,
            "flops_utilization": flops / self.peaks["flops"],
            "bandwidth_utilization": nbytes / self.peaks["bandwidth"]}

    def info(self) -> dict[str, Any]:
        """What the router needs: endpoints, role, model facts, KV peer info."""
        cfg = self.engine.model_config
        return {
            "worker_id": self.spec.worker_id, "role": self.spec.role,
            "endpoint": self.endpoint, "model_dir": str(self.engine.model_dir),
            "max_model_len": self.engine.max_model_len, "vocab_size": cfg.vocab_size,
            "block_size": self.spec.block_size, "num_blocks": self.engine.block_pool.num_blocks,
            "block_bytes": self.engine.kv_cache.block_bytes * cfg.num_layers,
            "peer_info": self.receiver.peer_info() if self.receiver is not None else None,
            "spec": asdict(self.spec), "torch_threads": torch.get_num_threads(),
        }

    def shutdown(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)
        self.loop.stop()
        for endpoint in (self.sender, self.receiver):
            if endpoint is not None:
                endpoint.close()
        self._ctx.destroy(linger=0)
