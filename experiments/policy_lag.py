"""What the autoscaler's decisions cost the router's event loop: in a thread of the router
against in the policy process (`cluster.autoscaler.policy_process`).

    python -m experiments.policy_lag --profile P.json [--decisions 5] [--max-workers 4]

An asyncio loop wakes every millisecond, as the router's does for each worker message,
while the policy decides on a documents-and-chat window (`experiments.autoscale_run`'s
phase A) `--decisions` times: idle (no decisions, the baseline), in a thread (`asyncio.to_thread`,
sharing the GIL), in the policy process. Prints each arm's decision time and how late the
loop woke (p50, p99, max): a thread holding the GIL delays every wake-up by up to the
interpreter's switch interval (5 ms).

    python -m experiments.policy_lag --profile P.json --workers [--seconds 20] [--rounds 2]

What the decisions cost the workers instead: two stand-in workers (Ray's niceness, 15;
one torch thread each, a decode step's matmul at batch 16) count their steps for
`--seconds` while the policy process decides back to back, under `SCHED_IDLE` (as
served) and at plain nice 19 (the fallback without `SCHED_IDLE`), against no policy at
all; the arms alternate `--rounds` times. Prints each arm's worker steps relative to no
policy and its decisions.

Both print their lines only: nothing is written to disk.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from cluster.autoscaler import decide, policy_process
from experiments.autoscale_run import LOCAL_PREFILL_THRESHOLD, experiment_slo, phase_requests
from planner.autoscale_policy import Autoscaler, AutoscalerConfig, Window
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


RAY_WORKER_NICENESS = 15


def _stand_in_worker(stop: Any, steps: Any) -> None:
    """Decode-step-sized matmuls at Ray's worker niceness until `stop`; adds its count."""
    import torch

    os.nice(RAY_WORKER_NICENESS - os.nice(0))
    torch.set_num_threads(1)
    rows, weight = torch.randn(16, 576), torch.randn(576, 1536)
    done = 0
    while not stop.is_set():
        for _ in range(10):
            rows @ weight
        done += 1
    with steps.get_lock():
        steps.value += done


def worker_cost(policy: Autoscaler, window: Window, seconds: float, rounds: int
                ) -> list[str]:
    """One line per arm: the stand-in workers' steps against no policy, and decisions."""
    context = multiprocessing.get_context("spawn")
    processes = {"SCHED_IDLE": policy_process(policy), "nice 19": policy_process(policy, False)}
    for process in processes.values():
        process.submit(int).result()
    results: dict[str, list[tuple[int, int]]] = {"none": [], **{k: [] for k in processes}}
    try:
        for _ in range(rounds):
            for arm in results:
                stop, steps = context.Event(), context.Value("q", 0)
                workers = [context.Process(target=_stand_in_worker, args=(stop, steps))
                           for _ in range(2)]
                for w in workers:
                    w.start()
                time.sleep(2.0)  # torch imported, steady
                with steps.get_lock():
                    steps.value = 0
                end, decisions, pending = time.monotonic() + seconds, 0, None
                while (left := end - time.monotonic()) > 0:
                    if arm == "none":
                        time.sleep(min(left, 0.1))
                        continue
                    if pending is None:
                        pending = processes[arm].submit(decide, 100.0 * (decisions + 1),
                                                        window, (1, 1))
                    try:
                        pending.result(timeout=left)
                    except TimeoutError:
                        break  # the deadline, mid-decision: not counted
                    decisions, pending = decisions + 1, None
                stop.set()  # each worker adds its count as it stops, within one step
                for w in workers:
                    w.join()
                if pending is not None:
                    pending.result()
                results[arm].append((steps.value, decisions))
    finally:
        for process in processes.values():
            process.shutdown()
    base = [n for n, _ in results["none"]]
    lines = []
    for arm, runs in results.items():
        ratios = ", ".join(f"{n / b:.3f}" for (n, _), b in zip(runs, base, strict=True))
        made = ", ".join(str(d) for _, d in runs)
        steps = ", ".join(str(n) for n, _ in runs)
        lines.append(f"{arm:10s} worker steps {steps} ({ratios} x none); decisions: {made}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, required=True)
    parser.add_argument("--decisions", type=int, default=5)
    parser.add_argument("--max-workers", type=int, default=4)
    parser.add_argument("--workers", action="store_true",
                        help="measure the decisions' cost to two busy stand-in workers")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    profile = Profile.load(args.profile)
    requests = [r for r in phase_requests("prefill-heavy", 40, 0.8, 0.0, 1) if r.timestamp < 20]
    window = Window(0.0, 20.0, [r.timestamp for r in requests],
                    [len(r.prompt_token_ids) for r in requests], [r.output_len for r in requests])
    config = AutoscalerConfig(experiment_slo(profile), "disaggregated", 2, args.max_workers,
                              min_prefill=0, cooldown_s=0.0, reuse_tolerance=0.0,
                              local_prefill_threshold=LOCAL_PREFILL_THRESHOLD)
    policy = Autoscaler(config, profile, profile)
    lines = (worker_cost(policy, window, args.seconds, args.rounds) if args.workers
             else asyncio.run(measure(policy, window, args.decisions)))
    for line in lines:
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
