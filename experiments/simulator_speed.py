"""How fast the simulator runs: simulated requests per wall-clock second.

    python -m experiments.simulator_speed --profile P.json [--requests 10000] [--config 16P+48D]
        [--step-cv CV]

A Poisson trace of random prompts (64-512 tokens) and outputs (16-128 tokens) at a rate
that keeps the workers busy but stable (`--load` of the configuration's rough capacity),
simulated once per repeat.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import numpy as np

from experiments.planner_accuracy import parse_config
from planner.measure import VOCAB
from planner.profile import Profile
from planner.simulator import Simulation
from protocol.serving import TraceRequest


def trace(num: int, rate: float, seed: int = 0) -> list[TraceRequest]:
    """`num` random requests arriving Poisson at `rate` (each draws its prompt, then its
    output length)."""
    rng = np.random.default_rng(seed)
    arrivals = np.concatenate(([0.0], np.cumsum(rng.exponential(1 / rate, num - 1))))
    requests = []
    for t in arrivals:
        prompt = rng.integers(*VOCAB, int(rng.integers(64, 513))).tolist()
        requests.append(TraceRequest(float(t), int(rng.integers(16, 129)), prompt))
    return requests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", required=True)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--config", default="16P+48D")
    parser.add_argument("--rate", type=float, default=None,
                        help="requests/s (default: 2 per worker-second of the profile's "
                             "unloaded request time x 0.5)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--step-cv", type=float, default=None,
                        help="the step times' spread (default: the profile's)")
    args = parser.parse_args(argv)
    profile = Profile.load(args.profile)
    if args.step_cv is not None:
        profile = replace(profile, step_cv=args.step_cv)
    shape = parse_config(args.config)
    if args.rate is None:
        # One request's unloaded work: a 288-token prefill plus 72 decode steps.
        work = profile.step_time([(0, 288, True)]) + 72 * profile.step_time([(288, 1, False)])
        args.rate = 0.5 * shape.num_workers / work
    requests = trace(args.requests, args.rate)
    times, steps = [], 0
    for _ in range(args.repeats):
        start = time.perf_counter()
        result = Simulation(shape, profile, profile).run(requests)
        times.append(time.perf_counter() - start)
        steps = result.num_steps
    best, median = min(times), statistics.median(times)
    print(f"{args.requests} requests at {args.rate:.1f} req/s on {args.config} "
          f"({shape.num_workers} workers): {median:.1f} s median of {args.repeats} "
          f"(best {best:.1f} s, worst {max(times):.1f} s) = {args.requests / median:.0f} "
          f"simulated requests/s, {steps / median:.0f} engine steps/s; "
          f"{result.num_steps} steps, {result.num_preemptions} preemptions; "
          f"step spread {profile.step_cv:g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
