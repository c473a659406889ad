"""Exposed KV transfer time: end of prefill to the request being ready on the decode side.

Runs the real prefill and decode workers (`cluster.worker.Worker`, no Ray) in two
processes on SmolLM2 over the same-host transport, drives them with the router's
`protocol` messages, and compares, per prompt length, the time the decode worker's reserved
blocks waited for the KV beyond the prefill itself (the `transfer` timing its first-token
record carries: router hops plus the part of the transfer that compute did not hide)
against the prefill time (the `prefill` timing). Layer-wise streaming should hide all but
the last layer.

    python -m experiments.kv_exposed [--lengths 512 2048] [--repeats 3] [--cross-host]

`--cross-host` (root) puts each worker on a host of its own (a network namespace joined to
this one by a veth bridge, `tests/multinode/netns.py`) with the KV over zmq.

Prints one line per length; `experiments.kv_bench` runs it too and keeps its figures.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
from typing import Any

import numpy as np

from commands.worker_pair import DEFAULT_SPEC, WorkerPair
from protocol.serving import DEFAULT_VOCAB_RANGE


def measure(lengths: list[int], repeats: int, seed: int = 0,
            cross_host: bool = False) -> dict[str, Any]:
    """Median exposed transfer time and its share of prefill time, per prompt length."""
    rng = np.random.default_rng(seed)
    with contextlib.ExitStack() as stack:
        pair = stack.enter_context(contextlib.closing(_pair(stack, cross_host)))
        return _measure(pair, rng, lengths, repeats)


def _pair(stack: contextlib.ExitStack, cross_host: bool) -> WorkerPair:
    if not cross_host:
        return WorkerPair()
    from tests.multinode.netns import Hosts, enter_netns, unavailable

    if (why := unavailable()) is not None:
        raise SystemExit(f"--cross-host needs network namespaces: {why}")
    hosts = stack.enter_context(contextlib.closing(Hosts(["prefill", "decode"])))
    spec = {**DEFAULT_SPEC, "transports": ("zmq",)}
    roles = {role: {"host": hosts[role].ip,
                    "setup": functools.partial(enter_netns, hosts[role].init_pid)}
             for role in ("prefill", "decode")}
    return WorkerPair(spec, roles, host=hosts.gateway)


def _measure(pair: WorkerPair, rng: np.random.Generator, lengths: list[int],
             repeats: int) -> dict[str, Any]:
    pair.once("warmup", rng.integers(*DEFAULT_VOCAB_RANGE, 64).tolist())
    results = {}
    for n in lengths:
        runs = [pair.once(f"p{n}-{i}", rng.integers(*DEFAULT_VOCAB_RANGE, n).tolist())
                for i in range(repeats)]
        results[str(n)] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cross-host", action="store_true",
                        help="each worker on a host of its own (network namespaces; root)")
    args = parser.parse_args(argv)
    results = measure(args.lengths, args.repeats, cross_host=args.cross_host)
    for n, r in results.items():
        print(f"{n:>5} tokens: prefill {r['prefill_s'] * 1e3:8.1f} ms, exposed transfer "
              f"{r['exposed_s'] * 1e3:6.2f} ms = {r['share']:.2%} of prefill")
    return results


if __name__ == "__main__":
    main()
