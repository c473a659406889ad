"""Tensor-parallel workers on a local Ray cluster: one prefill worker of the tiny model on
one rank feeding two decode workers each split over two ranks (rank 0 in the Ray actor's
process, rank 1 its child) over zmq: the KV a TP-1 worker sends lands in a pool whose every
head its two ranks read in place (`engine.llm_engine`'s whole pool), and the streams give
the offline engine's exact tokens. A decode rank SIGKILLed mid-stream ends its whole
worker, whose streams move to the other and finish with the same tokens; every pool ends
free. (Prefill at two ranks feeding one, and both directions over each transport:
tests/integration/test_transports.py.)"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import ray

from cluster.metrics import WorkerCollector
from engine import SamplingParams
from protocol import Role
from tests.integration.conftest import (
    collect_all,
    expected_tokens,
    random_prompts,
    start_cluster,
    wait_pools_free,
)
from tests.integration.test_faults import (
    _count,
    _handles,
    _placing_only_on,
    _pool_restored,
    _start,
    _until,
)

pytestmark = pytest.mark.cluster

LONG = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(ray_local, loop_thread):
    backend = start_cluster(loop_thread, num_prefill=1, num_decode=2, transports=("zmq",),
                            decode_worker={"tensor_parallel_size": 2, "num_blocks": 256})
    yield backend
    loop_thread.run(backend.close())


def test_tensor_parallel_workers_stream_the_engines_tokens(cluster, loop_thread, reference):
    workers = _handles(cluster, Role.DECODE)
    assert [(h.info.tensor_parallel_size, len(h.info.rank_pids)) for h in workers] == \
        [(2, 1), (2, 1)]
    status = loop_thread.run(cluster.status())
    assert (status["pool_settings"]["decode"]["tensor_parallel_size"],
            status["pool_settings"]["prefill"].get("tensor_parallel_size", 1)) == (2, 1)
    sizes = {s.labels["role"]: s.value for family in WorkerCollector(cluster, "tiny").collect()
             for s in family.samples if s.name == "pdcluster:worker_tensor_parallel_size"}
    assert sizes == {"prefill": 1, "decode": 2}
    shipped = _count(cluster, "kv_transfer_bytes")
    prompts = random_prompts(6, seed=41)  # 20 to 200 tokens: prefilled on the prefill worker
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    results = collect_all(loop_thread, cluster, prompts, params, prefix="tp")
    assert [tokens for tokens, _ in results] == expected_tokens(reference, prompts, params)
    assert all("transfer" in last.timings for _, last in results)
    # Each prompt's whole blocks moved, every KV head of them: a block costs the two-rank
    # pools what it costs the one-rank pool.
    stats = {h.worker_id: ray.get(h.actor.stats.remote(), timeout=30)
             for h in cluster.workers.values()}
    (block_bytes,) = {s.kv_block_bytes for s in stats.values()}
    blocks = sum(-(-len(p) // 16) for p in prompts)
    assert _count(cluster, "kv_transfer_bytes") - shipped == blocks * block_bytes
    wait_pools_free(loop_thread, cluster)


def test_a_killed_rank_ends_its_worker_and_its_streams_move(cluster, loop_thread, reference):
    """Four streams on one worker, stopped once each has tokens (so none ends before the
    fault); its rank 1 SIGKILLed, then the worker let go: its next step fails, the worker
    process ends, and each stream is placed again once on the other worker, ending with
    the offline engine's tokens."""
    prompts = random_prompts(4, seed=43, low=8, high=40)
    expected = expected_tokens(reference, prompts, LONG)
    migrated = _count(cluster, "migrations")

    async def go():
        victim = _handles(cluster, Role.DECODE)[0]
        with _placing_only_on(cluster, victim):
            clients, tasks = _start(cluster, prompts, LONG, k=3, prefix="tk")
            await asyncio.gather(*(c.ready.wait() for c in clients))
        os.kill(victim.info.pid, signal.SIGSTOP)  # nothing finishes after this count
        held = {rid: len(cluster.dispatcher.requests[rid].generated)
                for rid in victim.in_flight}
        (rank1,) = victim.info.rank_pids
        os.kill(rank1, signal.SIGKILL)
        os.kill(victim.info.pid, signal.SIGCONT)
        await asyncio.gather(*tasks)

        async def gone():
            return victim.worker_id not in cluster.workers
        await _until(gone, "the worker whose rank died to be gone")
        await _pool_restored(cluster, "decode", 2)
        return clients, held
    clients, held = loop_thread.run(go())
    assert sorted(held) == [c.rid for c in clients]
    assert all(3 <= n < 160 for n in held.values()), held
    assert [c.tokens for c in clients] == expected
    assert [c.last.finish_reason for c in clients] == ["length"] * 4
    assert _count(cluster, "migrations") - migrated == 4
    wait_pools_free(loop_thread, cluster)

