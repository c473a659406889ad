"""A prefill and a decode worker in two processes, driven with the router's messages and no
Ray: the exposed KV transfer measured between real workers (`pdcluster profile`, and the
KV experiments)."""

from __future__ import annotations

import multiprocessing as mp
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import zmq

from cluster.config import TRANSPORTS
from cluster.worker import WorkerSpec
from engine import SamplingParams
from planner.measure import VOCAB, ProfileSettings
from protocol import (
    Failed,
    Generate,
    Prefill,
    Reserved,
    Step,
    TokenRecord,
    WireSamplingParams,
    decode_reply,
    encode,
)

DEFAULT_SPEC = {"model": "smollm2", "kv_cache_memory_gb": 0.5, "torch_threads": 1,
         "max_num_batched_tokens": 4096, "transports": ("shm", "zmq")}


def _run_worker(spec: WorkerSpec, ready: Any, setup: Callable[[], None] | None) -> None:
    from cluster.worker import Worker

    if setup is not None:
        setup()
    worker = Worker(spec)
    ready.send(worker.info())
    ready.recv()  # until told to stop
    worker.shutdown()


class WorkerPair:
    """A prefill and a decode worker process, and the router end of their sockets.

    Args:
        spec: WorkerSpec fields for both workers (default: SmolLM2 over shm).
        roles: per role (`prefill`, `decode`), WorkerSpec fields that override `spec` and a
            picklable `setup` its process calls first (the experiments put each worker on
            a host of its own this way).
        host: the address this end's socket binds (the workers must reach it).
    """

    def __init__(self, spec: dict[str, Any] | None = None,
                 roles: dict[str, dict[str, Any]] | None = None,
                 host: str = "127.0.0.1") -> None:
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(f"tcp://{host}:0")
        endpoint = self.pull.getsockopt_string(zmq.LAST_ENDPOINT)
        spawn = mp.get_context("spawn")
        self.procs, self.pipes, self.infos, self.push = [], [], {}, {}
        for role in ("decode", "prefill"):
            ours, theirs = spawn.Pipe()
            overrides = dict((roles or {}).get(role, {}))
            setup = overrides.pop("setup", None)
            # Unique ids: the decode worker's shared-memory pool is named after it.
            worker = WorkerSpec(worker_id=f"{role}-{uuid.uuid4().hex[:8]}", role=role,
                                router_endpoint=endpoint, **{**(spec or DEFAULT_SPEC), **overrides})
            proc = spawn.Process(target=_run_worker, args=(worker, theirs, setup), daemon=True)
            proc.start()
            self.procs.append(proc)
            self.pipes.append(ours)
            self.infos[role] = ours.recv()
            self.push[role] = self.ctx.socket(zmq.PUSH)
            self.push[role].connect(self.infos[role].endpoint)

    def _reserved(self, request_id: str) -> Reserved:
        while True:
            message = decode_reply(self.pull.recv())
            if isinstance(message, Failed):
                raise RuntimeError(message.error)
            if isinstance(message, Reserved) and message.request_id == request_id:
                return message

    def _first_token(self, request_id: str) -> TokenRecord:
        while True:
            message = decode_reply(self.pull.recv())
            if isinstance(message, Failed):
                raise RuntimeError(message.error)
            if isinstance(message, Step):
                for record in message.outputs:
                    if record.request_id == request_id and record.token_ids:
                        return record

    def once(self, request_id: str, prompt: list[int]) -> dict[str, float]:
        """Reserve on the decode worker, prefill on the prefill worker, wait for the first
        token on the decode side.

        Returns:
            `prefill_s` (on the prefill worker), `exposed_s` (the KV wait beyond it) and
            their ratio `share`.
        """
        params = WireSamplingParams.from_params(
            SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        self.push["decode"].send(encode(Generate(
            request_id=request_id, prompt_token_ids=prompt, params=params,
            remote_prefill=True)))
        reserved = self._reserved(request_id)
        self.push["prefill"].send(encode(Prefill(
            request_id=request_id, prompt_token_ids=prompt, params=params,
            peer_info=self.infos["decode"].peer_info, dst_block_ids=reserved.dst_block_ids,
            num_cached_tokens=reserved.num_cached_tokens)))
        timings = self._first_token(request_id).timings or {}
        return {"prefill_s": timings["prefill"], "exposed_s": timings["transfer"],
                "share": timings["transfer"] / timings["prefill"]}

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send("stop")
        for proc in self.procs:
            proc.join(20)
        self.ctx.destroy(linger=0)


def transfer_samples(settings: ProfileSettings, lengths: Sequence[int], repeats: int,
                     tick: Callable[[], None]) -> list[dict[str, Any]]:
    """The exposed transfer against the blocks shipped, with real workers over the
    profile's transport (`planner.measure.TransferSampler`)."""
    spec = {"model": settings.model, "dtype": settings.dtype,
            "kv_cache_memory_gb": settings.kv_cache_gb, "block_size": settings.block_size,
            "torch_threads": settings.torch_threads, "max_num_batched_tokens": max(lengths),
            "transports": TRANSPORTS[settings.transport]}
    rng = np.random.default_rng((settings.seed, 1))
    samples = []
    pair = WorkerPair(spec)
    try:
        pair.once("warmup", rng.integers(*VOCAB, 64).tolist())
        for n in lengths:
            for i in range(repeats):
                r = pair.once(f"t{n}-{i}", rng.integers(*VOCAB, n).tolist())
                samples.append({"tokens": n, "blocks": -(-n // settings.block_size),
                                "y": r["exposed_s"], "prefill_s": r["prefill_s"]})
            tick()
    finally:
        pair.close()
    return samples
