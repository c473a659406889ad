"""`serve --autoscale`: the planner's autoscaling policy acting on a live cluster.

`RecordingBackend` wraps the cluster backend the router talks to and keeps the recent
window of requests (arrival, prompt tokens, output tokens). `AutoscalerLoop` asks the
policy (`planner.autoscale_policy.Autoscaler`) every interval and resizes through the backend's
live scale path (removed workers drain; in a rebalance once their replacements are
ready). The policy's simulations run in a child process scheduled only on CPU the rest
leaves idle (`SCHED_IDLE`), not in the router's: there they held the GIL against the
router's event loop and, at the router's priority, preempted the workers (which Ray runs
at nice 15). Each decision is logged with its reason and exported as
`pdcluster:autoscaler_*` metrics.
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
import os
import signal
import time
from collections.abc import AsyncIterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import replace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from planner.autoscale_policy import Autoscaler, Decision, Window
from protocol.serving import TraceRequest
from protocol.status import workers
from router.backend import Backend, GenerateRequest, ModelInfo, TokenDelta

log = logging.getLogger(__name__)


def serving(status: dict[str, Any], role: str) -> int:
    """Workers of `role` serving in a `Status`: ready, or `slow` (a busy worker whose stats
    are late, mid-step, is still there); draining ones are leaving."""
    return sum(1 for w in workers(status) if w.role == role and w.state in ("ready", "slow"))


class RecordingBackend(Backend):
    """Delegates to `inner` and remembers each request as a trace request: its arrival
    (monotonic seconds), prompt and output length.

    A request's output length is what it asked for until it finishes, then what it got.

    Args:
        inner: the cluster backend.
        horizon_s: how long requests are remembered.
    """

    def __init__(self, inner: Backend, horizon_s: float = 600.0) -> None:
        self.inner = inner
        self.horizon_s = horizon_s
        self.seen: dict[str, TraceRequest] = {}  # by request id, in arrival order

    def window(self, end: float, length_s: float, min_requests: int = 0) -> Window:
        """The requests that arrived in the last `length_s` seconds before `end` (monotonic
        seconds), or in the last 2, 3, ... times that: the shortest such window holding
        `min_requests` requests, within `horizon_s`. A slow stream is judged on enough
        requests to tell its mix, a fast one still on its last `length_s`."""
        while self.seen:
            oldest = next(iter(self.seen))
            if self.seen[oldest].timestamp >= end - self.horizon_s:
                break
            del self.seen[oldest]
        seen = list(self.seen.values())
        span = length_s
        if 0 < min_requests <= len(seen):
            oldest_needed = seen[-min_requests].timestamp
            span = min(length_s * max(math.ceil((end - oldest_needed) / length_s), 1),
                       self.horizon_s)
        chosen = [r for r in seen if end - span <= r.timestamp < end]
        return Window(end - span, end, [r.timestamp for r in chosen],
                      [len(r.prompt_token_ids or ()) for r in chosen],
                      [r.output_len for r in chosen])

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        rid = request.request_id
        self.seen[rid] = TraceRequest(time.monotonic(), request.params.max_tokens,
                                      request.prompt_token_ids)
        produced = 0
        async for delta in self.inner.generate(request):
            produced += len(delta.token_ids)
            if delta.finish_reason is not None and produced and rid in self.seen:
                self.seen[rid] = replace(self.seen[rid], output_len=produced)
            yield delta

    def model_info(self) -> ModelInfo:
        return self.inner.model_info()

    async def abort(self, request_id: str) -> bool:
        return await self.inner.abort(request_id)

    async def status(self) -> dict[str, Any]:
        return await self.inner.status()

    async def scale(self, num_prefill: int | None, num_decode: int | None) -> dict[str, Any]:
        return await self.inner.scale(num_prefill, num_decode)

    def healthy(self) -> bool:
        return self.inner.healthy()


class AutoscalerMetrics:
    """`pdcluster:autoscaler_*`: targets, the estimated load, decisions by action; every
    series carries `model_name`.

    Args:
        registry: where they are exported.
        model_name: the served model's name.
    """

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        model = ["model_name"]
        self.target = Gauge("pdcluster:autoscaler_target_workers",
                            "Workers the autoscaler last asked for, by role.", [*model, "role"],
                            registry=registry)
        self.rate = Gauge("pdcluster:autoscaler_estimated_rate_rps",
                          "Arrival rate estimated from the router's recent window.", model,
                          registry=registry).labels(model_name)
        self.attainment = Gauge("pdcluster:autoscaler_predicted_attainment",
                                "Predicted SLO attainment of the target split.", model,
                                registry=registry).labels(model_name)
        self.decisions = Counter("pdcluster:autoscaler_decisions",
                                 "Autoscaler decisions, by action.", [*model, "action"],
                                 registry=registry)
        self.model_name = model_name

    def record(self, decision: Decision) -> None:
        model = self.model_name
        self.target.labels(model, "prefill").set(decision.prefill)
        self.target.labels(model, "decode").set(decision.decode)
        self.rate.set(decision.rate_rps)
        if decision.predicted_attainment is not None:
            self.attainment.set(decision.predicted_attainment)
        self.decisions.labels(model, decision.action).inc()


class AutoscalerLoop:
    """Every interval: window -> policy -> live scale.

    The policy lives in a child process (`policy_process`), which keeps its cool-down and
    history; if that process dies, a fresh one takes over (its cool-down forgotten).

    Args:
        policy: the autoscaling policy.
        backend: the recording backend in front of the cluster.
        metrics: where decisions are exported.
    """

    def __init__(self, policy: Autoscaler, backend: RecordingBackend,
                 metrics: AutoscalerMetrics) -> None:
        self.policy = policy
        self.backend = backend
        self.metrics = metrics
        self._process = policy_process(policy)

    async def current(self) -> tuple[int, int]:
        """(prefill, decode) workers serving (`serving`)."""
        status = await self.backend.status()
        return serving(status, "prefill"), serving(status, "decode") + serving(status, "mixed")

    async def step(self, now: float) -> Decision:
        """Take one decision and carry it out."""
        config = self.policy.config
        window = self.backend.window(now, config.window_s, config.min_requests)
        current = await self.current()
        try:
            decision = await asyncio.wrap_future(
                self._process.submit(decide, now, window, current))
        except BrokenProcessPool:
            log.error("the autoscaler's policy process died; starting another")
            self._process.shutdown(wait=False, cancel_futures=True)
            self._process = policy_process(self.policy)
            raise
        log.info("autoscaler %s -> %dP+%dD: %s", decision.action, decision.prefill,
                 decision.decode, decision.reason)
        self.metrics.record(decision)
        if decision.action != "hold":
            prefill = decision.prefill if config.mode == "disaggregated" else None
            await self.backend.scale(prefill, decision.decode)
        return decision

    async def run(self) -> None:
        """Decide every `interval_s` until cancelled; a failed step is logged, not fatal."""
        try:
            while True:
                await asyncio.sleep(self.policy.config.interval_s)
                try:
                    await self.step(time.monotonic())
                except Exception:
                    log.exception("autoscaler step failed")
        finally:
            self.close()

    def close(self) -> None:
        """Stop the policy process."""
        self._process.shutdown(wait=False, cancel_futures=True)


def policy_process(policy: Autoscaler, idle: bool = True) -> ProcessPoolExecutor:
    """One spawned process holding `policy`, its simulations taking only the CPU that
    serving leaves: under `SCHED_IDLE` where the OS has it (`idle`), else at nice 19.

    Nice 19 alone is not enough: CFS weighs nice 19 against Ray's workers at nice 15 as 15
    to 36, so a simulating policy took about 30 % of a busy worker's core
    (`experiments.policy_lag --workers`); `SCHED_IDLE` weighs 3.
    """
    return ProcessPoolExecutor(1, multiprocessing.get_context("spawn"), _adopt,
                               (policy, idle))


_POLICY: Autoscaler | None = None


def _adopt(policy: Autoscaler, idle: bool) -> None:
    global _POLICY
    _POLICY = policy
    os.nice(19 - os.nice(0))
    if idle and hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    # Ctrl-C reaches the whole process group: the router drains and stops this process
    # itself (before, every Ctrl-C printed this process's KeyboardInterrupt traceback).
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def decide(now: float, window: Window, current: tuple[int, int]) -> Decision:
    """The policy's decision, run in the policy process (submit it to `policy_process`)."""
    assert _POLICY is not None, "the policy process starts with its policy"
    return _POLICY.decide(now, window, current)
