"""What the autoscaler's decisions cost the router's event loop: in a thread of the router
against in the policy process (`cluster.autoscaler.policy_process`).

    python -m planner.policy_lag --profile P.json [--decisions 5] [--max-workers 4]

An asyncio loop wakes every millisecond, as the router's does for each worker message,
while the policy decides on a documents-and-chat window (`planner.autoscale_run`'s phase
A) `--decisions` times: idle (no decisions, the baseline), in a thread (`asyncio.to_thread`,
sharing the GIL), in the policy process. Prints each arm's decision time and how late the
loop woke (p50, p99, max): a thread holding the GIL delays every wake-up by up to the
interpreter's switch interval (5 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np

from cluster.autoscaler import decide, policy_process
from planner.autoscale import Autoscaler, AutoscalerConfig, Window
from planner.autoscale_run import LOCAL_PREFILL_THRESHOLD, experiment_slo, phase_requests
from planner.profile import Profile


async def _lag(run: Callable[[int], Awaitable[object]], decisions: int
               ) -> tuple[float, np.ndarray]:
    """(seconds for the decisions, wake-up delays in ms) of a 1 ms ticker meanwhile."""
    delays: list[float] = []
    done = False

    async def tick() -> None:
        while not done:
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            delays.append(time.perf_counter() - start - 0.001)

    ticker = asyncio.create_task(tick())
    start = time.perf_counter()
    for i in range(decisions):
        await run(i)
    took = time.perf_counter() - start
    done = True
    await ticker
    return took, np.array(delays) * 1000


async def measure(policy: Autoscaler, window: Window, decisions: int) -> list[str]:
    """One line per arm."""
    process = policy_process(policy)
    process.submit(int).result()  # started (and its imports done) before timing

    async def idle(i: int) -> None:
        await asyncio.sleep(1.0)

    async def thread(i: int) -> None:
        await asyncio.to_thread(policy.decide, 100.0 * (i + 1), window, (1, 1))

    async def child(i: int) -> None:
        await asyncio.wrap_future(process.submit(decide, 100.0 * (i + 1), window, (1, 1)))

    lines = []
    try:
        for name, run in (("idle", idle), ("thread", thread), ("process", child)):
            took, delays = await _lag(run, decisions)
            p50, p99, worst = np.percentile(delays, [50, 99, 100])
            lines.append(f"{name:8s} {decisions} decisions in {took:5.2f} s; loop woke late by "
                         f"p50 {p50:.2f} ms, p99 {p99:.2f} ms, max {worst:.1f} ms "
                         f"({len(delays)} wake-ups)")
    finally:
        process.shutdown()
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, required=True)
    parser.add_argument("--decisions", type=int, default=5)
    parser.add_argument("--max-workers", type=int, default=4)
    args = parser.parse_args(argv)
    profile = Profile.load(args.profile)
    requests = [r for r in phase_requests("prefill-heavy", 40, 0.8, 0.0, 1) if r.arrival < 20]
    window = Window(0.0, 20.0, [r.arrival for r in requests],
                    [len(r.prompt_token_ids) for r in requests], [r.output_len for r in requests])
    config = AutoscalerConfig(experiment_slo(profile), "disaggregated", 2, args.max_workers,
                              min_prefill=0, cooldown_s=0.0,
                              local_prefill_threshold=LOCAL_PREFILL_THRESHOLD)
    for line in asyncio.run(measure(Autoscaler(config, profile, profile), window,
                                    args.decisions)):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
