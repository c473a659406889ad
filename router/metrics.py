"""The router's Prometheus metrics, in a registry of its own (served at `/metrics`).

Besides its own `pdcluster:` series, `RouterMetrics` keeps per-request series that only
`--metrics-compat vllm` exports, under vLLM's names (`collect_vllm`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

from router.admission import AdmissionQueue

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# Whole requests may run for minutes: vLLM's request latency buckets go on to 7680 s.
_REQUEST_LATENCY_BUCKETS = (*_LATENCY_BUCKETS, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                  0.5, 0.75, 1.0, 2.5)


def token_count_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value`: vLLM's buckets of per-request token
    counts (`build_1_2_5_buckets(max_model_len)`)."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(float(mantissa * scale))
        scale *= 10


class ModelBoundMetric:
    """A labelled metric with its leading `model_name` label filled in, used as the metric."""

    def __init__(self, metric: Counter | Histogram, model_name: str) -> None:
        self._metric = metric
        self._model_name = model_name
        self.label_names: tuple[str, ...] = tuple(metric._labelnames[1:])

    def labels(self, *values: str) -> Counter | Histogram:
        return self._metric.labels(self._model_name, *values)


class RouterMetrics:
    """Request latencies, outcomes and queue depth; every series carries `model_name`.

    Args:
        admission: the queue whose running and waiting counts the gauges report.
        model_name: the served model's name.
        max_model_len: the model's context; the top bucket of the per-request token count
            histograms (None: 100,000).
    """

    def __init__(self, admission: AdmissionQueue, model_name: str,
                 max_model_len: int | None = None) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.admission = admission
        self._own: list[MetricWrapperBase] = []
        self._vllm: list[MetricWrapperBase] = []

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            metric = Histogram(f"pdcluster:{name}", doc, ["model_name"], buckets=buckets,
                               registry=self.registry)
            self._own.append(metric)
            return metric.labels(model_name)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            metric = Counter(f"pdcluster:{name}", doc, ["model_name", *labels],
                             registry=self.registry)
            self._own.append(metric)
            return ModelBoundMetric(metric, model_name) if labels else metric.labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds",
                              "Arrival at the router to the first output token.",
                              _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Time between consecutive output tokens.", _TOKEN_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Per request: first to last output token over the tokens after "
                              "the first.", _TOKEN_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Arrival at the router to the last output.",
                             _REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Time spent in the admission queue.",
                                    _REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "Admission to the first output token (placement, "
                                      "prefill and KV transfer).", _REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds",
                                     "First to last output token.", _REQUEST_LATENCY_BUCKETS)
        self.finished = counter("requests_finished", "Finished requests.", ("finish_reason",))
        self.rejected = counter("requests_rejected",
                                "Requests refused before generation, by status code.",
                                ("code",))
        self.aborted = counter("requests_aborted",
                               "Requests ended early, by an Abort call or a client disconnect.",
                               ("cause",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens admitted.")
        self.generation_tokens = counter("generation_tokens", "Output tokens generated.")
        for name, doc, read in (
                ("num_requests_running", "Requests admitted into the backend.",
                 lambda: admission.num_running),
                ("num_requests_waiting", "Requests in the admission queue.",
                 lambda: admission.num_waiting)):
            gauge = Gauge(f"pdcluster:{name}", doc, ["model_name"], registry=self.registry)
            gauge.labels(model_name).set_function(read)
            self._own.append(gauge)

        def vllm_histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            metric = Histogram(name, doc, ["model_name"], buckets=buckets, registry=None)
            self._vllm.append(metric)
            return metric.labels(model_name)

        counts = token_count_buckets(max_model_len or 100_000)
        self.request_prompt_tokens = vllm_histogram(
            "vllm:request_prompt_tokens", "Per finished request: its prompt tokens.", counts)
        self.request_generation_tokens = vllm_histogram(
            "vllm:request_generation_tokens", "Per finished request: its output tokens.",
            counts)
        self.inference_time = vllm_histogram(
            "vllm:request_inference_time_seconds",
            "Per finished request: admission to the last output token (placement, prefill, "
            "KV transfer and decode).", _REQUEST_LATENCY_BUCKETS)

    def observe_finished(self, prompt_tokens: int, generation_tokens: int,
                         inference_s: float) -> None:
        """Record a finished request in the per-request series `--metrics-compat vllm`
        exports: its prompt and output token counts, and admission to its last token."""
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        self.inference_time.observe(inference_s)

    def collect_vllm(self) -> Iterator[Metric]:
        """The per-request series only `--metrics-compat vllm` exports, by vLLM's names."""
        for metric in self._vllm:
            yield from metric.collect()

    def collect_own(self) -> Iterator[Metric]:
        """The router's own series, without collectors others registered in `registry`."""
        for metric in self._own:
            yield from metric.collect()
