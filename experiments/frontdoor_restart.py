"""How long a killed front door of `pdcluster serve --detach` takes to serve again.

A local Ray cluster (this process is its driver), a detached cluster on it (launched by
the real CLI in a child process), then `--kills` times: `ray.kill` the front door actor
(Ray restarts it), time until `/health` answers 200 and until a greedy request has its
tokens again, and check the same worker processes serve.

    python -m experiments.frontdoor_restart --model tiny --kills 5

Raw output: experiments/results/frontdoor_restart.json (the times of every kill).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import ray

from cluster.frontdoor import NAMESPACE, frontdoor_name
from router.client import PdClusterClient

READY = re.compile(r"gRPC (\S+)\s+OpenAI (\S+)/v1")


def _pids(grpc_address: str) -> dict[str, int]:
    with PdClusterClient(grpc_address, timeout=30) as client:
        return {w["worker_id"]: w["pid"] for ws in client.status()["pools"].values()
                for w in ws}


def _wait(check, timeout_s: float = 300.0) -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError("not back")
        time.sleep(0.05)
    return time.monotonic()


def _health(http_base: str) -> bool:
    try:
        return httpx.get(http_base + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _served(grpc_address: str) -> bool:
    try:
        with PdClusterClient(grpc_address, timeout=30) as client:
            outs = list(client.generate(prompt_token_ids=list(range(300, 340)), max_tokens=8,
                                        temperature=0.0, ignore_eos=True))
        return sum(len(o.token_ids) for o in outs) == 8
    except Exception:  # not back yet
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--out", type=Path,
                        default=Path("experiments/results/frontdoor_restart.json"))
    args = parser.parse_args()
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False, namespace=NAMESPACE)
    address, name = ray.get_runtime_context().gcs_address, f"exp{os.getpid()}"
    launched = subprocess.run(
        [sys.executable, "-m", "commands.cli", "serve", "--detach", "--name", name,
         "--address", address, "--model", args.model, "--kv-cache-gb", "0.25",
         "--grpc-port", "0", "--http-port", "0"], capture_output=True, text=True, check=True)
    grpc_address, http_base = READY.search(launched.stdout).groups()
    try:
        door = ray.get_actor(frontdoor_name(name))
        pids = _pids(grpc_address)
        runs = []
        for _ in range(args.kills):
            killed = time.monotonic()
            ray.kill(door, no_restart=False)
            health = _wait(lambda: _health(http_base)) - killed
            served = _wait(lambda: _served(grpc_address)) - killed
            assert _pids(grpc_address) == pids, "the workers changed"
            runs.append({"health_s": health, "served_s": served})
            print(f"back: /health 200 after {health:.1f} s, tokens after {served:.1f} s",
                  flush=True)
        summary = {key: {"min": min(r[key] for r in runs),
                         "median": statistics.median(r[key] for r in runs),
                         "max": max(r[key] for r in runs)} for key in runs[0]}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"model": args.model, "workers": pids, "runs": runs,
                                        "summary": summary}, indent=2))
        print(json.dumps(summary, indent=2))
    finally:
        subprocess.run([sys.executable, "-m", "commands.cli", "stop", "--address", address,
                        "--name", name], capture_output=True, timeout=180)
        ray.shutdown()


if __name__ == "__main__":
    main()
