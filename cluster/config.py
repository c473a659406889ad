"""How the cluster's pools are built (`ClusterConfig`) and where its sockets live."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import ray

from engine import defaults as engine_defaults
from protocol import Role
from protocol.defaults import DRAIN_TIMEOUT_S, LOCAL_PREFILL_THRESHOLD, RESERVE_TIMEOUT_S
from protocol.logs import LogConfig
from protocol.tracing import TracingConfig
from router.auth import is_loopback

INTERNAL_AUTH = ("auto", "curve", "off")
MODES = ("disaggregated", "colocated")
# `serve --transport` -> the KV transports a decode worker offers, best first: shared
# memory is never chosen between hosts, so zmq backs it up there.
TRANSPORTS = {"shm": ("shm", "zmq"), "zmq": ("zmq",), "torch": ("torch_dist", "zmq"),
              "mooncake": ("mooncake", "zmq")}
# Engine settings that fix the KV layout: a prefill and a decode pool must agree on them.
KV_LAYOUT_KEYS = ("dtype", "kv_cache_dtype", "block_size")


@dataclass(frozen=True)
class PoolSpec:
    """How every worker of one pool is placed and built.

    Args:
        num_cpus: Ray CPUs per worker.
        num_gpus: Ray GPUs per worker; a fraction shares a GPU, and then each worker's
            `gpu_memory_utilization` must fit in that fraction (or `kv_cache_memory_gb`
            size its KV pool).
        resource: a Ray custom resource every worker of the pool asks a sliver of, so the
            pool lands only on nodes started with it (`ray start --resources`); None: the
            pool's default label (`pd_prefill`, `pd_decode`) where some node offers it,
            else anywhere.
        engine: engine settings of its workers (`WorkerSpec` fields: `dtype`,
            `max_num_seqs`, `torch_threads`, ...).

    Raises:
        ValueError: a field out of range, or workers sharing a GPU that would claim more
            of its memory than their share, naming the flags.
    """

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resource: str | None = None
    engine: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_cpus < 0:
            raise ValueError(f"num-cpus-per-worker must be >= 0, got {self.num_cpus}")
        if self.num_gpus < 0:
            raise ValueError(f"num-gpus-per-worker must be >= 0, got {self.num_gpus}")
        if self.engine.get("tensor_parallel_size", 1) < 1:
            raise ValueError(f"tensor-parallel-size must be >= 1, got "
                             f"{self.engine['tensor_parallel_size']}")
        if self.engine.get("gpu_memory_utilization") is not None and not self.num_gpus:
            raise ValueError("gpu-memory-utilization sizes the KV pool from accelerator "
                             "memory, but these workers get no GPU (num-gpus-per-worker 0): "
                             "size it with kv-cache-gb")
        self._check_gpu_share()

    def _check_gpu_share(self) -> None:
        """Workers sharing a GPU must each claim at most their share of its memory: the
        default share is the whole GPU's (as in vLLM), so two workers on one GPU would each
        size their KV pool for 90 % of it and the second would run out of memory."""
        if not 0 < self.num_gpus < 1 or self.engine.get("kv_cache_memory_gb") is not None:
            return  # a whole GPU each, none, or an absolute KV pool instead of a share
        share = self.engine.get("gpu_memory_utilization")
        claimed = engine_defaults.GPU_MEMORY_UTILIZATION if share is None else share
        if claimed <= self.num_gpus:
            return
        given = "the default " if share is None else ""
        fit = engine_defaults.GPU_MEMORY_UTILIZATION * self.num_gpus
        raise ValueError(f"num-gpus-per-worker {self.num_gpus:g} puts up to "
                         f"{int(1 / self.num_gpus)} workers on one GPU, but each would hold "
                         f"{given}gpu-memory-utilization {claimed:g} of its memory: give "
                         f"each at most its share (--gpu-memory-utilization {fit:g}) or an "
                         "absolute KV pool (--kv-cache-gb)")

    def settings(self) -> dict[str, Any]:
        """Everything that builds one worker of the pool, flat (for `status`)."""
        placement = {k: v for k, v in asdict(self).items() if k != "engine"}
        return {**placement, **self.engine}


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
        local_prefill_threshold: uncached prompts this short are prefilled on the decode worker.
        reserve_timeout_s: how long a request may wait for decode KV to free up.
        drain_timeout_s: how long a drained worker's requests may take to finish before
            they are moved to other workers.
        migrate: place a dead or drained worker's requests again (else they end in error).
        internal_auth: security of the internal ZMQ sockets (router <-> workers, KV
            transfer): `curve` encrypts them and admits only holders of the cluster's key,
            `off` is plain TCP, `auto` is `curve` unless the internal host is loopback on a
            single-node Ray cluster.
        prefill: how prefill workers are placed and built.
        decode: how decode (or colocated) workers are placed and built; every worker the
            cluster starts for a pool (at start, `scale`, the autoscaler, a replacement
            for a dead one) gets its pool's spec.
        tracing: where the router and the workers export their spans
            (`--otlp-traces-endpoint`); None: no tracing.
        log: the level and format of every worker's log (`--log-level`, `--log-format`).
        ttft_slo_s: the TTFT objective in seconds (`serve --slo`'s tightest TTFT bound):
            workers serve waiting prompts that can still meet it first
            (`engine.scheduler.Scheduler.order_waiting`); None: in arrival order.

    Raises:
        ValueError: a field out of range, naming it.
    """

    model: str = "smollm2"
    mode: str = "disaggregated"
    num_prefill: int = 1
    num_decode: int = 1
    transports: tuple[str, ...] = TRANSPORTS["shm"]
    host: str = "127.0.0.1"
    local_prefill_threshold: int = LOCAL_PREFILL_THRESHOLD
    reserve_timeout_s: float = RESERVE_TIMEOUT_S
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    migrate: bool = True
    internal_auth: str = "auto"
    prefill: PoolSpec = PoolSpec()
    decode: PoolSpec = PoolSpec()
    tracing: TracingConfig | None = None
    log: LogConfig = field(default_factory=LogConfig)
    ttft_slo_s: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be disaggregated or colocated, got {self.mode!r}")
        if self.num_decode < 1:
            raise ValueError(f"num_decode must be >= 1, got {self.num_decode}")
        if self.num_prefill < 0:
            raise ValueError(f"num_prefill must be >= 0, got {self.num_prefill}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.reserve_timeout_s < 0:
            raise ValueError(f"reserve_timeout_s must be >= 0, got {self.reserve_timeout_s}")
        if self.internal_auth not in INTERNAL_AUTH:
            raise ValueError(f"internal_auth must be one of {INTERNAL_AUTH}, "
                             f"got {self.internal_auth!r}")
        if self.ttft_slo_s is not None and not self.ttft_slo_s > 0:
            raise ValueError(f"ttft_slo_s must be > 0 or None, got {self.ttft_slo_s}")
        if self.mode == "disaggregated":
            for key in KV_LAYOUT_KEYS:  # KV blocks move between the pools as they are
                ours, theirs = self.prefill.engine.get(key), self.decode.engine.get(key)
                if ours != theirs:
                    raise ValueError(f"prefill and decode {key.replace('_', '-')} differ "
                                     f"({ours} vs {theirs}): KV blocks move between the "
                                     "pools as they are, so they must match")

    def pool(self, role: Role) -> PoolSpec:
        """The spec of the pool a worker of `role` belongs to."""
        return self.decode if role.decodes else self.prefill

    def pool_resource(self, decodes: bool) -> tuple[str, bool]:
        """The custom resource a worker of that pool asks for, and whether it was named
        (required) rather than the default label (used only where offered)."""
        named = (self.decode if decodes else self.prefill).resource
        return (named, True) if named else (f"pd_{'decode' if decodes else 'prefill'}", False)

    def pool_settings(self) -> dict[str, dict[str, Any]]:
        """Each pool's effective settings by role name, as `status` shows them."""
        if self.mode == "colocated":
            return {str(Role.MIXED): self.decode.settings()}
        return {str(Role.PREFILL): self.prefill.settings(),
                str(Role.DECODE): self.decode.settings()}

    @property
    def num_workers(self) -> int:
        """Workers the pools start with."""
        return self.num_decode + (self.num_prefill if self.mode == "disaggregated" else 0)


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
