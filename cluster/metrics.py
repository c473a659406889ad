"""Per-worker Prometheus metrics, read from the stats each worker pushes twice a second."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import accumulate
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from engine.stats import STEP_TOKEN_BUCKETS
from router.metrics import ModelBoundMetric

_TRANSFER_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
# KV bytes of one request: SmolLM2-135M takes 23 KiB (fp32) or 6 KiB (int8) per token.
_REQUEST_BYTES_BUCKETS = tuple(2.0**k for k in range(16, 33, 2))  # 64 KiB .. 4 GiB

_GAUGES = {
    "worker_kv_usage": ("kv_usage", "Fraction of the worker's KV blocks in use."),
    "worker_running_requests": ("num_running", "Requests in the worker's running batch."),
    "worker_waiting_requests": ("num_waiting", "Requests queued inside the worker."),
    "worker_prefix_cache_hit_rate": ("prefix_hit_rate", "Prompt tokens served from cache."),
    "worker_spec_acceptance_rate": ("spec_acceptance_rate",
                                    "Speculative decoding: drafted tokens accepted, as a share."),
    "worker_spec_tokens_per_step": ("spec_tokens_per_step",
                                    "Speculative decoding: tokens emitted per verify step."),
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
    "worker_prefix_cache_queries": ("prefix_cache_queries",
                                    "Prompt tokens looked up in the prefix cache."),
    "worker_prefix_cache_hits": ("prefix_cache_hits",
                                 "Prompt tokens found in the prefix cache."),
    "worker_spec_draft_tokens": ("spec_draft_tokens", "Speculative tokens drafted."),
    "worker_spec_accepted_tokens": ("spec_accepted_tokens", "Speculative tokens accepted."),
    "worker_spec_verify_steps": ("spec_verify_steps",
                                 "Request-steps that verified speculative tokens."),
}
# `--metrics-compat vllm`: vLLM's names for the same quantities, so dashboards, KEDA rules
# and llm-d's scheduler written for vLLM read pdcluster unchanged. Worker series carry
# vLLM's `engine` label (the worker id); the router's queue is the `engine="router"` series
# of num_requests_waiting.
_VLLM_WORKER_GAUGES = {
    "vllm:num_requests_running": ("num_running", "Requests in the worker's running batch."),
    "vllm:num_requests_waiting": ("num_waiting", "Requests waiting inside the worker."),
    "vllm:kv_cache_usage_perc": ("kv_usage", "Fraction of KV-cache blocks in use (0-1)."),
}
_VLLM_WORKER_COUNTERS = {
    "vllm:num_preemptions": ("num_preemptions",
                             "Requests preempted (KV freed, recomputed later)."),
    "vllm:prefix_cache_queries": ("prefix_cache_queries",
                                  "Prompt tokens looked up in the prefix cache."),
    "vllm:prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "vllm:spec_decode_num_drafts": ("spec_verify_steps", "Speculative drafts verified."),
    "vllm:spec_decode_num_draft_tokens": ("spec_draft_tokens", "Speculative tokens drafted."),
    "vllm:spec_decode_num_accepted_tokens": ("spec_accepted_tokens",
                                             "Speculative tokens accepted."),
}
# Router series re-exported under vLLM's names (same values, same buckets).
_VLLM_ROUTER_NAMES = {
    "pdcluster:time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "pdcluster:inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "pdcluster:request_time_per_output_token_seconds":
        "vllm:request_time_per_output_token_seconds",
    "pdcluster:e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "pdcluster:request_queue_time_seconds": "vllm:request_queue_time_seconds",
    "pdcluster:request_prefill_time_seconds": "vllm:request_prefill_time_seconds",
    "pdcluster:request_decode_time_seconds": "vllm:request_decode_time_seconds",
    "pdcluster:prompt_tokens": "vllm:prompt_tokens",
    "pdcluster:generation_tokens": "vllm:generation_tokens",
    "pdcluster:requests_finished": "vllm:request_success",
}


class ClusterMetrics:
    """The cluster's own series, in a registry of their own that `WorkerCollector`
    re-exports: KV transfers, and requests placed again. Every series carries `model_name`.

    Args:
        model_name: the served model's name.

    Attributes:
        registry: where they live.
        transfer_seconds: end of prefill to KV landed on the decode worker, per transfer.
        transfer_bytes: KV bytes shipped from prefill to decode workers, by transport.
        request_transfer_bytes: KV bytes shipped for one request, by transport (its
            `_sum` over its `_count` is the mean bytes per transferred request).
        migrations: requests placed again because their worker died or was drained.
        transfer_retries: failed KV transfers retried on another prefill worker or locally.
        spread_moves: running requests moved onto a worker that joined the decode pool.
    """

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        model = ["model_name"]
        self.transfer_seconds = Histogram(
            "pdcluster:kv_transfer_seconds", "End of prefill to KV landed on the decode worker.",
            model, buckets=_TRANSFER_BUCKETS, registry=self.registry).labels(model_name)
        self.transfer_bytes = ModelBoundMetric(Counter(
            "pdcluster:kv_transfer_bytes",
            "KV bytes shipped from prefill to decode workers, by transport.",
            [*model, "transport"], registry=self.registry), model_name)
        self.request_transfer_bytes = ModelBoundMetric(Histogram(
            "pdcluster:kv_transfer_request_bytes",
            "KV bytes shipped from prefill to decode for one request, by transport.",
            [*model, "transport"], buckets=_REQUEST_BYTES_BUCKETS, registry=self.registry),
            model_name)
        self.migrations = Counter(
            "pdcluster:migrations",
            "Requests placed again because their worker died or was drained.",
            model, registry=self.registry).labels(model_name)
        self.transfer_retries = Counter(
            "pdcluster:transfer_retries",
            "Failed KV transfers retried on another prefill worker or locally.",
            model, registry=self.registry).labels(model_name)
        self.spread_moves = Counter(
            "pdcluster:spread_moves",
            "Running requests moved onto a worker that joined the decode pool, to even the "
            "pool's load.", model, registry=self.registry).labels(model_name)

    def value(self, name: str) -> float:
        """A counter's total over its labels (`migrations`, `kv_transfer_bytes`, ...)."""
        return sum(sample.value for metric in self.registry.collect()
                   for sample in metric.samples if sample.name == f"pdcluster:{name}_total")


class WorkerCollector(Collector):
    """Exports every worker's latest stats and the cluster's KV transfer totals.

    Args:
        backend: the `ClusterBackend` whose workers are reported (`workers`, `metrics`).
        model_name: the served model's name (the `model_name` label).
    """

    def __init__(self, backend: Any, model_name: str) -> None:
        self.backend = backend
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        workers = list(self.backend.workers.values())
        labels = ["model_name", "worker_id", "role"]
        for table, family, source in ((_GAUGES, GaugeMetricFamily, "stats"),
                                      (_UTILIZATION, GaugeMetricFamily, "utilization"),
                                      (_COUNTERS, CounterMetricFamily, "stats")):
            for name, (key, doc) in table.items():
                metric = family(f"pdcluster:{name}", doc, labels=labels)
                for h in workers:
                    values = None if h.stats is None else \
                        h.stats if source == "stats" else h.stats.utilization
                    if values is not None:
                        metric.add_metric([self.model_name, h.worker_id, h.role],
                                          getattr(values, key))
                yield metric
        info = GaugeMetricFamily(
            "pdcluster:worker_kv_cache_info",
            "The worker's KV pool: its page dtype as a label, its blocks as the value.",
            labels=[*labels, "kv_cache_dtype"])
        for h in workers:
            if h.stats is not None:
                info.add_metric([self.model_name, h.worker_id, h.role, h.stats.kv_cache_dtype],
                                h.stats.num_blocks)
        yield info
        ranks = GaugeMetricFamily(
            "pdcluster:worker_tensor_parallel_size",
            "Ranks the worker's model is split over (tensor parallelism; 1: whole).",
            labels=labels)
        for h in workers:
            ranks.add_metric([self.model_name, h.worker_id, h.role],
                             h.info.tensor_parallel_size)
        yield ranks
        yield from self.backend.metrics.registry.collect()


class VllmCompatCollector(Collector):
    """vLLM-named series (`--metrics-compat vllm`): per-worker load and prefix-cache counters
    with vLLM's `engine` label, each worker's `vllm:cache_config_info` and
    `vllm:iteration_tokens_total`, the router queue, the router's latency histograms and
    token counters renamed, and its per-request token count and inference time histograms
    (`RouterMetrics.collect_vllm`).

    Args:
        backend: the `ClusterBackend` whose workers are reported.
        router_metrics: the router's `RouterMetrics`.
    """

    def __init__(self, backend: Any, router_metrics: Any) -> None:
        self.backend = backend
        self.router_metrics = router_metrics

    def collect(self) -> Iterator[Metric]:
        model = self.router_metrics.model_name
        workers = list(self.backend.workers.values())
        labels = ["model_name", "engine"]
        for table, family in ((_VLLM_WORKER_GAUGES, GaugeMetricFamily),
                              (_VLLM_WORKER_COUNTERS, CounterMetricFamily)):
            for name, (key, doc) in table.items():
                metric = family(name, doc, labels=labels)
                for h in workers:
                    if h.stats is not None:
                        metric.add_metric([model, h.worker_id], getattr(h.stats, key))
                if name == "vllm:num_requests_waiting":
                    metric.add_metric([model, "router"],
                                      self.router_metrics.admission.num_waiting)
                yield metric
        yield self._cache_config_info(model, workers)
        yield self._iteration_tokens(model, workers)
        yield from self.router_metrics.collect_vllm()
        for family in self.router_metrics.collect_own():
            new_name = _VLLM_ROUTER_NAMES.get(family.name)
            if new_name is None:
                continue
            renamed = Metric(new_name, family.documentation, family.type)
            for sample in family.samples:
                renamed.add_sample(new_name + sample.name[len(family.name):], sample.labels,
                                   sample.value, sample.timestamp, sample.exemplar)
            yield renamed

    @staticmethod
    def _cache_config_info(model: str, workers: list[Any]) -> Metric:
        """vLLM's info gauge of each engine's KV cache config (always 1; the figures are
        labels): tokens per block, KV blocks, the KV dtype; pdcluster keeps no CPU blocks."""
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
            labels=["model_name", "engine", "block_size", "num_gpu_blocks", "num_cpu_blocks",
                    "cache_dtype"])
        for h in workers:
            if h.stats is not None:
                info.add_metric([model, h.worker_id, str(h.info.block_size),
                                 str(h.stats.num_blocks), "0", h.stats.kv_cache_dtype], 1)
        return info

    @staticmethod
    def _iteration_tokens(model: str, workers: list[Any]) -> Metric:
        """vLLM's histogram of the tokens each engine step computed, per engine, from the
        bucket counts each worker keeps of its steps (`WorkerStats.step_token_counts`).
        One series per worker, as vLLM's: a sum over the pool would drop whenever a
        worker left it, which `rate()` reads as a counter reset."""
        histogram = HistogramMetricFamily(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            labels=["model_name", "engine"])
        bounds = [str(float(le)) for le in STEP_TOKEN_BUCKETS] + ["+Inf"]
        for h in workers:
            if h.stats is not None and h.stats.step_token_counts:
                counts = list(accumulate(h.stats.step_token_counts))
                histogram.add_metric([model, h.worker_id], list(zip(bounds, counts, strict=True)),
                                     sum_value=h.stats.step_tokens)
        return histogram
