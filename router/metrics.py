"""The router's Prometheus metrics, in a registry of its own (served at `/metrics`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from router.admission import AdmissionQueue

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                  0.5, 0.75, 1.0, 2.5)


class RouterMetrics:
    """Request latencies, outcomes and queue depth.

    Args:
        admission: the queue whose running and waiting counts the gauges report.
    """

    def __init__(self, admission: AdmissionQueue) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("pdcluster:time_to_first_token_seconds",
                              "Arrival at the router to the first output token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdcluster:inter_token_latency_seconds",
                             "Time between consecutive output tokens.",
                             buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("pdcluster:e2e_request_latency_seconds",
                             "Arrival at the router to the last output.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("pdcluster:request_queue_time_seconds",
                                    "Time spent in the admission queue.",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.finished = Counter("pdcluster:requests_finished", "Finished requests.",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("pdcluster:requests_rejected",
                                "Requests refused before generation, by status code.",
                                ["code"], registry=r)
        self.aborted = Counter("pdcluster:requests_aborted",
                               "Requests ended early, by an Abort call or a client disconnect.",
                               ["cause"], registry=r)
        self.prompt_tokens = Counter("pdcluster:prompt_tokens", "Prompt tokens admitted.",
                                     registry=r)
        self.generation_tokens = Counter("pdcluster:generation_tokens",
                                         "Output tokens generated.", registry=r)
        Gauge("pdcluster:num_requests_running", "Requests admitted into the backend.",
              registry=r).set_function(lambda: admission.num_running)
        Gauge("pdcluster:num_requests_waiting", "Requests in the admission queue.",
              registry=r).set_function(lambda: admission.num_waiting)
