"""How long `plan --max-accelerators` takes to pick: Llama-3-8B on analytic H100-SXM
profiles at TP 1, 2, 4 and 8 per role, both modes, at 16 and at 64 accelerators
(docs/benchmarks.md, "Search and simulator speed").

    pdcluster profile --analytic --hardware H100-SXM --model-config llama-3-8b \\
        --tp 1,2,4,8 --out h100.json
    python -m experiments.search_speed trace --rate 60 --requests 1200 --out t16.jsonl
    pdcluster plan --prefill-profile h100.tp1.json,h100.tp2.json,h100.tp4.json,h100.tp8.json \\
        --decode-profile (the same) --trace t16.jsonl --slo ttft_p90_ms=1000,tpot_p90_ms=40 \\
        --max-accelerators 16 --cost-per-accelerator-hour-prefill 2.5 \\
        --cost-per-accelerator-hour-decode 2.5 [--no-pareto] -o p16.json
    (64 accelerators: --rate 240 --requests 2400)
    python -m experiments.search_speed summary p16.json p64.json --out S.json

The plan file's `search` holds the counts and the wall and CPU seconds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from planner.measure import VOCAB

SEED = 0


def trace(num: int, rate: float, seed: int = SEED) -> list[dict[str, Any]]:
    """Poisson arrivals at `rate`; prompts of 500-2999 random token ids, outputs of
    100-399 tokens."""
    rng = np.random.default_rng(seed)
    times = np.concatenate(([0.0], np.cumsum(rng.exponential(1 / rate, num - 1))))
    return [{"timestamp": round(float(t), 6), "output_len": int(rng.integers(100, 400)),
             "prompt_token_ids": rng.integers(*VOCAB, int(rng.integers(500, 3000))).tolist()}
            for t in times]


def summary(paths: list[Path]) -> dict[str, Any]:
    """Per plan file: the budget, the search's counts and seconds, and the pick."""
    runs = []
    for path in paths:
        doc = json.loads(path.read_text())
        pick = doc["recommended"]
        runs.append({"file": path.name, "rate_rps": round(doc["rate_rps"], 2),
                     "requests": doc["num_requests"], **doc["search"],
                     "pareto": None if doc["pareto"] is None else len(doc["pareto"]),
                     "recommended": None if pick is None else
                     {k: pick[k] for k in ("mode", "prefill", "prefill_tp", "decode",
                                           "decode_tp", "accelerators", "cost_per_hour")}})
    return {"runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("trace")
    t.add_argument("--rate", type=float, required=True)
    t.add_argument("--requests", type=int, required=True)
    t.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("summary")
    s.add_argument("plans", type=Path, nargs="+")
    s.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.cmd == "trace":
        args.out.write_text("".join(json.dumps(r) + "\n"
                                    for r in trace(args.requests, args.rate)))
    else:
        args.out.write_text(json.dumps(summary(args.plans), indent=1) + "\n")


if __name__ == "__main__":
    main()
