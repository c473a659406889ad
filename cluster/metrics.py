"""Per-worker Prometheus metrics, read from the stats each worker pushes twice a second."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_TRANSFER_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)

_GAUGES = {
    "worker_kv_usage": ("kv_usage", "Fraction of the worker's KV blocks in use."),
    "worker_running_requests": ("num_running", "Requests in the worker's running batch."),
    "worker_waiting_requests": ("num_waiting", "Requests queued inside the worker."),
    "worker_prefix_cache_hit_rate": ("prefix_hit_rate", "Prompt tokens served from cache."),
}
_UTILIZATION = {
    "worker_busy_fraction": ("busy", "Share of time the engine was computing."),
    "worker_idle_fraction": ("idle", "Share of time the engine had nothing to do."),
    "worker_transfer_wait_fraction": ("transfer_wait",
                                      "Share of time idle while requests waited for KV."),
    "worker_flops_utilization": ("flops_utilization",
                                 "Model FLOP/s over the measured matmul peak (MFU)."),
    "worker_bandwidth_utilization": ("bandwidth_utilization",
                                     "Bytes read per second over the measured bandwidth."),
}
_COUNTERS = {
    "worker_prefill_tokens": ("prefill_tokens", "Prompt tokens computed."),
    "worker_decode_tokens": ("decode_tokens", "Tokens decoded."),
}


def transfer_metrics() -> tuple[CollectorRegistry, Histogram, Counter]:
    """The cluster's KV transfer metrics, in a registry of their own that `WorkerCollector`
    re-exports (a backend owns one; tests build the same one).

    Returns:
        (registry, seconds per transfer: end of prefill to KV landed on the decode worker,
        bytes shipped from prefill to decode workers).
    """
    registry = CollectorRegistry()
    seconds = Histogram("pdcluster:kv_transfer_seconds",
                        "End of prefill to KV landed on the decode worker.",
                        buckets=_TRANSFER_BUCKETS, registry=registry)
    nbytes = Counter("pdcluster:kv_transfer_bytes",
                     "KV bytes shipped from prefill to decode workers.", registry=registry)
    return registry, seconds, nbytes


class WorkerCollector(Collector):
    """Exports every worker's latest stats and the cluster's KV transfer totals.

    Args:
        backend: the `ClusterBackend` whose workers are reported.
    """

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def collect(self) -> Iterator[Metric]:
        workers = list(self.backend.workers.values())
        labels = ["worker_id", "role"]
        for table, family, source in ((_GAUGES, GaugeMetricFamily, "stats"),
                                      (_UTILIZATION, GaugeMetricFamily, "utilization"),
                                      (_COUNTERS, CounterMetricFamily, "stats")):
            for name, (key, doc) in table.items():
                metric = family(f"pdcluster:{name}", doc, labels=labels)
                for h in workers:
                    values = h.stats if source == "stats" else h.stats.get("utilization", {})
                    if key in values:
                        metric.add_metric([h.worker_id, h.role], values[key])
                yield metric
        yield from self.backend.transfer_registry.collect()


# ---- resilience (issue 10): faults the cluster absorbed -------------------------------

def resilience_metrics(registry: CollectorRegistry) -> tuple[Counter, Counter]:
    """Counters of requests the cluster saved from a fault, in the backend's registry.

    Returns:
        (requests placed again after their worker died or was drained,
        KV transfers retried after a failure).
    """
    migrations = Counter("pdcluster:migrations",
                         "Requests placed again because their worker died or was drained.",
                         registry=registry)
    retries = Counter("pdcluster:transfer_retries",
                      "Failed KV transfers retried on another prefill worker or locally.",
                      registry=registry)
    return migrations, retries
