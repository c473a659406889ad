"""The router's Prometheus metrics, in a registry of its own (served at `/metrics`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

from router.admission import AdmissionQueue

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                  0.5, 0.75, 1.0, 2.5)


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
    """

    def __init__(self, admission: AdmissionQueue, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.admission = admission
        self._own: list[MetricWrapperBase] = []

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
                             "Arrival at the router to the last output.", _LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Time spent in the admission queue.", _LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "Admission to the first output token (placement, "
                                      "prefill and KV transfer).", _LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds",
                                     "First to last output token.", _LATENCY_BUCKETS)
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

    def collect_own(self) -> Iterator[Metric]:
        """The router's own series, without collectors others registered in `registry`."""
        for metric in self._own:
            yield from metric.collect()
