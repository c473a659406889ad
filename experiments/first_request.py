"""The README's first request, as a new user sends it: `make serve`'s cluster (SmolLM2,
1 prefill + 1 decode worker) and the README's `curl` body, tried `--tries` times in a row;
each try's answer, finish reason, completion tokens and wall time. `--body sampled` leaves
the temperature out, so the model's generation config samples (SmolLM2's card: temperature
0.2, top_p 0.9).

Protocol: one server, the tries one after another (no concurrency), nothing else running;
every try is reported, none dropped.

Rerun: `.venv/bin/python -m experiments.first_request [--tries 5] [--body readme|sampled]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request
from pathlib import Path
from typing import Any

from commands.launch import pdcluster_serve
from engine.hardware import cpu_paths

RESULTS = Path("experiments/results/first_request")
QUESTION = "What is the capital of France?"
BODIES = {
    "readme": {"model": "smollm2", "max_tokens": 64, "temperature": 0,
               "messages": [{"role": "user", "content": QUESTION}]},
    "sampled": {"model": "smollm2", "max_tokens": 64,
                "messages": [{"role": "user", "content": QUESTION}]},
}


def ask(base_url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One chat completion: the answer, its finish reason and size, and the wall time."""
    request = urllib.request.Request(f"{base_url}/chat/completions",
                                     json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=900) as resp:
        answer = json.load(resp)
    seconds = time.perf_counter() - start
    choice = answer["choices"][0]
    return {"answer": choice["message"]["content"], "finish_reason": choice["finish_reason"],
            "completion_tokens": answer["usage"]["completion_tokens"],
            "seconds": round(seconds, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=5)
    parser.add_argument("--body", choices=sorted(BODIES), default="readme")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    out = args.out or RESULTS / f"{args.body}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    body = BODIES[args.body]
    with pdcluster_serve("smollm2", ["--prefill", "1", "--decode", "1"],
                         out.with_suffix(".log")) as endpoints:
        tries = []
        for i in range(args.tries):
            tries.append(ask(endpoints.http, body))
            print(f"try {i + 1}: {tries[-1]}", flush=True)
    seconds = [t["seconds"] for t in tries]
    report = {"cpu": cpu_paths().describe(), "body": body, "tries": tries,
              "seconds_median": statistics.median(seconds), "seconds_max": max(seconds),
              "answers": sorted({t["answer"] for t in tries})}
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "tries"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
