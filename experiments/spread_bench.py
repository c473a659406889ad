"""What spreading running requests onto a worker that joins the decode pool buys.

On a local Ray cluster of SmolLM2 workers (one thread each), 1P+1D serves `--chats`
answers decoding together on its one decode worker; once each has streamed `--after`
tokens the cluster rebalances to 0P+2D. With the spread (`Dispatcher.spread_onto`) half of
them move onto the worker that joined (recomputing their prompt and tokens so far);
without it (the dispatcher's `migrate` off) they all finish on the first one. Rounds
alternate the two, on the same cluster and prompts, so the machine's drift falls on both
alike. Per round: the median over requests of the time per output token after the move,
the time until the last one ends, and the longest pause between two tokens of one request
(a move's recompute shows there).

    python -m experiments.spread_bench [--chats 16] [--max-tokens 160] [--after 16] [--rounds 4]

Writes `experiments/results/spread/spread.json` (`--out`).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray

from cluster.backend import ClusterBackend
from cluster.config import ClusterConfig, PoolSpec
from engine import SamplingParams, defaults
from experiments import RESULTS
from router.backend import GenerateRequest


def _moves(backend: ClusterBackend) -> float:
    return backend.metrics.value("spread_moves")


async def _round(backend: ClusterBackend, prompts: list[list[int]], params: SamplingParams,
                 after: int, tag: str) -> dict[str, Any]:
    times: dict[int, list[float]] = {i: [] for i in range(len(prompts))}

    async def consume(i: int) -> None:
        request = GenerateRequest(f"{tag}-{i}", prompts[i], params, time.monotonic())
        async for delta in backend.generate(request):
            if delta.finish_reason == "error":
                raise RuntimeError(delta.error)
            times[i] += [time.monotonic()] * len(delta.token_ids)

    jobs = [asyncio.ensure_future(consume(i)) for i in range(len(prompts))]
    while min(len(t) for t in times.values()) < after:
        await asyncio.sleep(0.005)
    moved_before = _moves(backend)
    await backend.scale(num_prefill=0, num_decode=2)
    move = time.monotonic()
    await asyncio.gather(*jobs)
    after_move = [(t[-1] - move) / sum(1 for x in t if x > move) for t in times.values()]
    gaps = [max(b - a for a, b in itertools.pairwise(t)) for t in times.values()]
    await backend.scale(num_prefill=1, num_decode=1)
    return {"moved": _moves(backend) - moved_before,
            "tpot_after_move_ms_p50": 1e3 * statistics.median(after_move),
            "last_done_s": max(t[-1] for t in times.values()) - move,
            "longest_gap_ms": 1e3 * max(gaps)}


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    import random

    rng = random.Random(7)
    prompts = [[rng.randrange(100, 49000) for _ in range(rng.randint(16, 48))]
               for _ in range(args.chats)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    pool = PoolSpec(engine={"torch_threads": 1, "kv_cache_memory_gb": defaults.KV_CACHE_GB,
                            "max_num_batched_tokens": defaults.MAX_NUM_BATCHED_TOKENS})
    config = ClusterConfig(model="smollm2", num_prefill=1, num_decode=1,
                           local_prefill_threshold=64, prefill=pool, decode=pool)
    backend = ClusterBackend(config)
    await backend.start()
    rounds: dict[str, list[dict[str, Any]]] = {"spread": [], "none": []}
    try:
        for r in range(args.rounds):
            for arm in ("spread", "none") if r % 2 == 0 else ("none", "spread"):
                # The dispatcher's policy gates both the spread and migration.
                backend.dispatcher.config = replace(backend.dispatcher.config,
                                                    migrate=arm == "spread")
                result = await _round(backend, prompts, params, args.after, f"{arm}{r}")
                rounds[arm].append(result)
                print(arm, r, {k: round(v, 3) for k, v in result.items()}, flush=True)
    finally:
        await backend.close()
    ratio = [s["tpot_after_move_ms_p50"] / n["tpot_after_move_ms_p50"]
             for s, n in zip(rounds["spread"], rounds["none"], strict=True)]
    done = [s["last_done_s"] / n["last_done_s"]
            for s, n in zip(rounds["spread"], rounds["none"], strict=True)]
    return {"args": vars(args), "rounds": rounds,
            "tpot_after_move_ratio": ratio, "last_done_ratio": done}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chats", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--after", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path, default=RESULTS / "spread" / "spread.json",
                        help="default experiments/results/spread/spread.json")
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        result = asyncio.run(_main(args))
    finally:
        ray.shutdown()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print("spread / none, time per token after the move (median of requests):",
          [round(x, 3) for x in result["tpot_after_move_ratio"]])
    print("spread / none, time until the last request ends:",
          [round(x, 3) for x in result["last_done_ratio"]])


if __name__ == "__main__":
    main()
