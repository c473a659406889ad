"""A local Ray instance and a cluster on the tiny model, driven from a background event loop."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Coroutine
from typing import Any

import pytest
import ray

from cluster.backend import ClusterBackend
from cluster.config import ClusterConfig, PoolSpec
from engine import LLM, CacheConfig, SamplingParams
from router.backend import GenerateRequest, TokenDelta


class LoopThread:
    """An asyncio loop on its own thread; `run` blocks on a coroutine scheduled there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine, timeout: float = 300) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="session")
def ray_local():
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.stop()


def start_cluster(loop_thread: LoopThread, **overrides: Any) -> ClusterBackend:
    """A cluster on the tiny model; `worker` overrides engine settings of both pools,
    `prefill_worker` and `decode_worker` of one."""
    worker = {"num_blocks": 128, "block_size": 16, "max_num_batched_tokens": 512,
              "torch_threads": 1}
    worker.update(overrides.pop("worker", {}))
    prefill, decode = (PoolSpec(num_cpus=1, engine={**worker, **overrides.pop(key, {})})
                       for key in ("prefill_worker", "decode_worker"))
    config = ClusterConfig(model="tiny", local_prefill_threshold=8, prefill=prefill,
                           decode=decode, **overrides)
    backend = loop_thread.run(_make(config))
    return backend


async def _make(config: ClusterConfig) -> ClusterBackend:
    backend = ClusterBackend(config)
    await backend.start()
    return backend


async def collect(backend: ClusterBackend, rid: str, prompt: list[int],
                  params: SamplingParams) -> tuple[list[int], TokenDelta]:
    tokens: list[int] = []
    async for delta in backend.generate(GenerateRequest(rid, prompt, params, time.monotonic())):
        tokens.extend(delta.token_ids)
        last = delta
    return tokens, last


def collect_all(loop_thread: LoopThread, backend: ClusterBackend, prompts: list[list[int]],
                params: SamplingParams, prefix: str = "r") -> list[tuple[list[int], TokenDelta]]:
    """Every prompt's tokens and last delta, all submitted at once (ids `prefix0`, ...)."""
    async def go() -> list[tuple[list[int], TokenDelta]]:
        return await asyncio.gather(*(collect(backend, f"{prefix}{i}", p, params)
                                      for i, p in enumerate(prompts)))
    return loop_thread.run(go())


def wait_pools_free(loop_thread: LoopThread, backend: ClusterBackend, timeout: float = 20) -> None:
    """Every worker's KV pool fully free and nothing running (stats pulled via Ray)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = [ray.get(h.actor.stats.remote(), timeout=30) for h in backend.workers.values()]
        busy = [s for s in stats if s.num_free_blocks != s.num_blocks or s.num_running
                or s.num_waiting or s.num_parked]
        if not busy:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pools not free: {busy}")
        time.sleep(0.1)


def random_prompts(n: int, seed: int, low: int = 20, high: int = 200) -> list[list[int]]:
    """`n` seeded random prompts of `low` to `high` tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(rng.randint(low, high))]
            for _ in range(n)]


@pytest.fixture(scope="module")
def reference() -> LLM:
    """The tiny model run offline: the exact tokens a cluster must stream."""
    return LLM("tiny", cache=CacheConfig(num_blocks=512))


def expected_tokens(reference: LLM, prompts: list[list[int]],
                    params: SamplingParams) -> list[list[int]]:
    """The reference's greedy tokens for each prompt."""
    return [o.outputs[0].token_ids for o in reference.generate(prompts, params)]
