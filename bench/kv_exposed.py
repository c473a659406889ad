"""Exposed KV transfer time: end of prefill to the request being ready on the decode side.

Runs the real prefill and decode workers (`cluster.worker.Worker`, no Ray) in two
processes on SmolLM2 over the same-host transport, drives them with the router's
messages, and compares, per prompt length, the time from the prefill worker's end of
prefill (its `prefilled` message) to the decode worker's first-token message (the KV
landed, the request joined the batch) against the prefill time. Layer-wise streaming
should hide all but the last layer.

    python -m bench.kv_exposed [--lengths 512 2048] [--repeats 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
import uuid
from dataclasses import asdict
from typing import Any

import numpy as np
import zmq

from cluster.worker import WorkerSpec, pack, unpack
from engine import SamplingParams

_SPEC = {"model": "smollm2", "kv_cache_memory_gb": 0.5, "torch_threads": 1,
         "max_num_batched_tokens": 4096, "transports": ("shm", "zmq")}


def _run_worker(spec: WorkerSpec, ready: Any) -> None:
    from cluster.worker import Worker

    worker = Worker(spec)
    ready.send(worker.info())
    ready.recv()  # until told to stop
    worker.shutdown()


class WorkerPair:
    """A prefill and a decode worker process, and the router end of their sockets.

    Args:
        spec: WorkerSpec fields for both workers (default: SmolLM2 over shm).
    """

    def __init__(self, spec: dict[str, Any] | None = None) -> None:
        self.ctx = zmq.Context()
        self.seen: dict[tuple[str, str], tuple[dict[str, Any], float]] = {}
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind("tcp://127.0.0.1:0")
        endpoint = self.pull.getsockopt_string(zmq.LAST_ENDPOINT)
        spawn = mp.get_context("spawn")
        self.procs, self.pipes, self.infos, self.push = [], [], {}, {}
        for role in ("decode", "prefill"):
            ours, theirs = spawn.Pipe()
            # Unique ids: the decode worker's shared-memory pool is named after it.
            worker = WorkerSpec(worker_id=f"{role}-{uuid.uuid4().hex[:8]}", role=role,
                                router_endpoint=endpoint, **(spec or _SPEC))
            proc = spawn.Process(target=_run_worker, args=(worker, theirs), daemon=True)
            proc.start()
            self.procs.append(proc)
            self.pipes.append(ours)
            self.infos[role] = ours.recv()
            self.push[role] = self.ctx.socket(zmq.PUSH)
            self.push[role].connect(self.infos[role]["endpoint"])

    def wait_for(self, request_id: str, kind: str) -> tuple[dict[str, Any], float]:
        """The first `kind` message for the request (`step`: its first token), and when it
        came. The two workers push to one socket, so a `step` can overtake `prefilled`:
        messages that come early are kept for a later call."""
        while (request_id, kind) not in self.seen:
            message = unpack(self.pull.recv())
            now = time.monotonic()
            if message["type"] == "error":
                raise RuntimeError(message["error"])
            if message["type"] == "step":
                for record in message["outputs"]:
                    if record["token_ids"]:
                        self.seen.setdefault((record["request_id"], "step"), (record, now))
            elif "request_id" in message:
                self.seen.setdefault((message["request_id"], message["type"]), (message, now))
        return self.seen.pop((request_id, kind))

    def once(self, request_id: str, prompt: list[int]) -> dict[str, float]:
        params = asdict(SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        base = {"request_id": request_id, "prompt_token_ids": prompt, "params": params}
        self.push["decode"].send(pack({**base, "type": "generate", "remote_prefill": True}))
        reserved, _ = self.wait_for(request_id, "reserved")
        self.push["prefill"].send(pack({
            **base, "type": "prefill", "peer_info": self.infos["decode"]["peer_info"],
            "dst_block_ids": reserved["dst_block_ids"],
            "num_cached_tokens": reserved["num_cached_tokens"]}))
        prefilled, _ = self.wait_for(request_id, "prefilled")
        _, ready = self.wait_for(request_id, "step")
        exposed = ready - prefilled["prefill_end"]
        return {"prefill_s": prefilled["prefill_s"], "exposed_s": exposed,
                "share": exposed / prefilled["prefill_s"]}

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send("stop")
        for proc in self.procs:
            proc.join(20)
        self.ctx.destroy(linger=0)


def measure(lengths: list[int], repeats: int, seed: int = 0) -> dict[str, Any]:
    """Median exposed transfer time and its share of prefill time, per prompt length."""
    rng = np.random.default_rng(seed)
    pair = WorkerPair()
    try:
        pair.once("warmup", rng.integers(100, 49000, 64).tolist())
        results = {}
        for n in lengths:
            runs = [pair.once(f"p{n}-{i}", rng.integers(100, 49000, n).tolist())
                    for i in range(repeats)]
            results[str(n)] = {key: statistics.median(r[key] for r in runs)
                               for key in runs[0]}
    finally:
        pair.close()
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    results = measure(args.lengths, args.repeats)
    for n, r in results.items():
        print(f"{n:>5} tokens: prefill {r['prefill_s'] * 1e3:8.1f} ms, exposed transfer "
              f"{r['exposed_s'] * 1e3:6.2f} ms = {r['share']:.2%} of prefill")
    return results


if __name__ == "__main__":
    main()
