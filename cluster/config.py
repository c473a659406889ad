"""How the cluster's pools are built (`ClusterConfig`) and where its sockets live."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ray

from protocol.defaults import DRAIN_TIMEOUT_S, LOCAL_PREFILL_THRESHOLD, RESERVE_TIMEOUT_S
from protocol.tracing import TracingConfig
from router.auth import is_loopback

INTERNAL_AUTH = ("auto", "curve", "off")
MODES = ("disaggregated", "colocated")
# `serve --transport` -> the KV transports a decode worker offers, best first: shared
# memory is never chosen between hosts, so zmq backs it up there.
TRANSPORTS = {"shm": ("shm", "zmq"), "zmq": ("zmq",), "torch": ("torch_dist", "zmq"),
              "mooncake": ("mooncake", "zmq")}


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
        prefill_resource: a Ray custom resource every prefill worker asks a sliver of, so
            the pool lands only on nodes started with it (`ray start --resources`); None:
            `pd_prefill` where some node offers it, else anywhere.
        decode_resource: the same for decode (and colocated) workers; None: `pd_decode`
            where offered.
        internal_auth: security of the internal ZMQ sockets (router <-> workers, KV
            transfer): `curve` encrypts them and admits only holders of the cluster's key,
            `off` is plain TCP, `auto` is `curve` unless the internal host is loopback on a
            single-node Ray cluster.
        worker: engine settings shared by all workers (`WorkerSpec` fields).
        tracing: where the router and the workers export their spans
            (`--otlp-traces-endpoint`); None: no tracing.

    Raises:
        ValueError: a field out of range, naming it.
    """

    model: str = "smollm2"
    mode: str = "disaggregated"
    num_prefill: int = 1
    num_decode: int = 1
    transports: tuple[str, ...] = TRANSPORTS["shm"]
    host: str = "127.0.0.1"
    num_cpus_per_worker: float = 1.0
    num_gpus_per_worker: float = 0.0
    torch_threads: int | None = 1
    local_prefill_threshold: int = LOCAL_PREFILL_THRESHOLD
    reserve_timeout_s: float = RESERVE_TIMEOUT_S
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    migrate: bool = True
    internal_auth: str = "auto"
    prefill_resource: str | None = None
    decode_resource: str | None = None
    worker: dict[str, Any] = field(default_factory=dict)
    tracing: TracingConfig | None = None

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

    def pool_resource(self, decodes: bool) -> tuple[str, bool]:
        """The custom resource a worker of that pool asks for, and whether it was named
        (required) rather than the default label (used only where offered)."""
        named = self.decode_resource if decodes else self.prefill_resource
        return (named, True) if named else (f"pd_{'decode' if decodes else 'prefill'}", False)

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
