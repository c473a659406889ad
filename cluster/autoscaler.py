"""`serve --autoscale`: the planner's autoscaling policy acting on a live cluster.

`RecordingBackend` wraps the cluster backend the router talks to and keeps the recent
window of requests (arrival, prompt tokens, output tokens). `AutoscalerLoop` asks the
policy (`planner.autoscale.Autoscaler`) every interval and resizes through the backend's
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
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from planner.autoscale import Autoscaler, Decision, Window
from router.backend import Backend, GenerateRequest, ModelInfo, TokenDelta

log = logging.getLogger(__name__)


def serving(pools: dict[str, list[dict[str, Any]]], role: str) -> int:
    """Workers of `role` serving in a status's `pools`: ready, or `slow` (a busy worker
    whose stats are late, mid-step, is still there); draining ones are leaving."""
    return sum(1 for w in pools.get(role, []) if w.get("state") in ("ready", "slow"))


@dataclass
class _Seen:
    arrival: float
    prompt_len: int
    output_len: int


class RecordingBackend(Backend):
    """Delegates to `inner` and remembers each request's arrival and lengths.

    A request's output length is what it asked for until it finishes, then what it got.

    Args:
        inner: the cluster backend.
        horizon_s: how long requests are remembered.
    """

    def __init__(self, inner: Backend, horizon_s: float = 600.0) -> None:
        self.inner = inner
        self.horizon_s = horizon_s
        self._seen: deque[_Seen] = deque()

    def window(self, end: float, length_s: float, min_requests: int = 0) -> Window:
        """The requests that arrived in the last `length_s` seconds before `end` (monotonic
        seconds), or in the last 2, 3, ... times that: the shortest such window holding
        `min_requests` requests, within `horizon_s`. A slow stream is judged on enough
        requests to tell its mix, a fast one still on its last `length_s`."""
        while self._seen and self._seen[0].arrival < end - self.horizon_s:
            self._seen.popleft()
        span = length_s
        if 0 < min_requests <= len(self._seen):
            oldest = self._seen[-min_requests].arrival
            span = min(length_s * max(math.ceil((end - oldest) / length_s), 1),
                       self.horizon_s)
        chosen = [s for s in self._seen if end - span <= s.arrival < end]
        return Window(end - span, end, [s.arrival for s in chosen],
                      [s.prompt_len for s in chosen], [s.output_len for s in chosen])

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        seen = _Seen(time.monotonic(), len(request.prompt_token_ids), request.params.max_tokens)
        self._seen.append(seen)
        produced = 0
        async for delta in self.inner.generate(request):
            produced += len(delta.token_ids)
            if delta.finish_reason is not None and produced:
                seen.output_len = produced
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
    """`pdcluster:autoscaler_*`: targets, the estimated load, decisions by action."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.target = Gauge("pdcluster:autoscaler_target_workers",
                            "Workers the autoscaler last asked for, by role.", ["role"],
                            registry=registry)
        self.rate = Gauge("pdcluster:autoscaler_estimated_rate_rps",
                          "Arrival rate estimated from the router's recent window.",
                          registry=registry)
        self.attainment = Gauge("pdcluster:autoscaler_predicted_attainment",
                                "Predicted SLO attainment of the target split.",
                                registry=registry)
        self.decisions = Counter("pdcluster:autoscaler_decisions",
                                 "Autoscaler decisions, by action.", ["action"],
                                 registry=registry)

    def record(self, decision: Decision) -> None:
        self.target.labels("prefill").set(decision.prefill)
        self.target.labels("decode").set(decision.decode)
        self.rate.set(decision.rate_rps)
        if decision.predicted_attainment is not None:
            self.attainment.set(decision.predicted_attainment)
        self.decisions.labels(decision.action).inc()


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
        pools = (await self.backend.status())["pools"]
        return serving(pools, "prefill"), serving(pools, "decode") + serving(pools, "mixed")

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
    (`planner.policy_lag --workers`); `SCHED_IDLE` weighs 3.
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
