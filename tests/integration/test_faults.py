"""Fault injection on a local Ray cluster: real SIGKILL / SIGSTOP of worker processes.

Every scenario ends with every request answered and every worker's KV pool fully free.
Faults are timed on observable events (a stream has yielded k tokens, a worker holds
requests, status shows a state), never on sleeps.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field

import pytest

from engine import SamplingParams
from router.backend import GenerateRequest
from tests.integration.conftest import (
    expected_tokens,
    random_prompts,
    start_cluster,
    wait_pools_free,
)

LONG = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(ray_local, loop_thread):
    # Short KV waits so a stalled prefill worker turns into a transfer failure quickly.
    backend = start_cluster(loop_thread, num_prefill=2, num_decode=2,
                            worker={"num_blocks": 256, "kv_wait_timeout_s": 4.0})
    yield backend
    loop_thread.run(backend.close())


@dataclass
class _Client:
    """One streaming request consumed in the background; `ready` fires after k tokens."""

    rid: str
    k: int
    tokens: list[int] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    last: object = None


async def _consume(backend, client: _Client, prompt: list[int], params: SamplingParams):
    request = GenerateRequest(client.rid, prompt, params, time.monotonic())
    async for delta in backend.generate(request):
        client.tokens.extend(delta.token_ids)
        client.last = delta
        if len(client.tokens) >= client.k or delta.finish_reason:
            client.ready.set()
    client.ready.set()


def _start(backend, prompts, params, k, prefix):
    clients = [_Client(f"{prefix}{i}", k) for i in range(len(prompts))]
    tasks = [asyncio.ensure_future(_consume(backend, c, p, params))
             for c, p in zip(clients, prompts, strict=True)]
    return clients, tasks


async def _workers(backend, role: str) -> list[dict]:
    return (await backend.status())["pools"].get(role, [])


async def _until(predicate, what: str, timeout: float = 120.0):
    """Poll an observable condition (status, counters) until it holds."""
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def _pool_restored(backend, role: str, n: int):
    async def ok():
        return sum(w["state"] == "ready" for w in await _workers(backend, role)) == n
    await _until(ok, f"{n} ready {role} workers")


def _count(backend, name: str) -> float:
    return backend.metrics.value(name)


def test_decode_sigkill_mid_stream_streams_continue_with_identical_tokens(
        cluster, loop_thread, reference):
    prompts = random_prompts(6, seed=11, low=40, high=120)
    migrated_before = _count(cluster, "migrations")

    async def go():
        clients, tasks = _start(cluster, prompts, LONG, k=3, prefix="dk")
        await asyncio.gather(*(c.ready.wait() for c in clients))
        victim = max(await _workers(cluster, "decode"), key=lambda w: w["in_flight"])
        assert victim["in_flight"] > 0
        os.kill(victim["pid"], signal.SIGKILL)
        await asyncio.gather(*tasks)
        await _pool_restored(cluster, "decode", 2)
        return clients, victim
    clients, victim = loop_thread.run(go())
    assert [c.tokens for c in clients] == expected_tokens(reference, prompts, LONG)
    assert all(c.last.finish_reason == "length" for c in clients)
    assert _count(cluster, "migrations") - migrated_before >= 1
    assert victim["worker_id"] not in cluster.workers
    wait_pools_free(loop_thread, cluster)


def test_a_finished_stream_its_client_has_not_read_is_not_placed_again(
        cluster, loop_thread, reference):
    """The decode worker dies after the last token reached the router but before the client
    read it: the stream ends as it was (the worker had let it go), and no second attempt
    starts (it would decode past the end on another worker, its tokens thrown away)."""
    prompt = random_prompts(1, seed=14, low=40, high=120)[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    before = _count(cluster, "migrations")

    async def go():
        stream_out = cluster.generate(GenerateRequest("unread", prompt, params,
                                                      time.monotonic()))
        first = await anext(stream_out)
        stream = cluster.dispatcher.requests["unread"]

        async def all_tokens_in():
            return len(stream.generated) == params.max_tokens
        await _until(all_tokens_in, "the last token at the router")
        victim = cluster.workers[stream.decode]
        os.kill(victim.info["pid"], signal.SIGKILL)

        async def death_seen():  # and its requests evacuated: both happen together
            return victim.worker_id not in cluster.workers
        await _until(death_seen, "the death seen")
        await _pool_restored(cluster, "decode", 2)
        deltas = [first] + [delta async for delta in stream_out]
        return deltas, victim.worker_id
    deltas, victim = loop_thread.run(go())
    assert [t for d in deltas for t in d.token_ids] == expected_tokens(reference, [prompt],
                                                                       params)[0]
    assert deltas[-1].finish_reason == "length"
    assert _count(cluster, "migrations") == before
    assert victim not in cluster.workers
    wait_pools_free(loop_thread, cluster)


def test_prefill_sigkill_places_its_requests_again(cluster, loop_thread, reference):
    prompts = random_prompts(4, seed=12, low=40, high=120)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    before = _count(cluster, "migrations") + _count(cluster, "transfer_retries")

    async def go():
        prefill = await _workers(cluster, "prefill")
        for w in prefill:  # freeze both so the requests are caught inside them
            os.kill(w["pid"], signal.SIGSTOP)
        try:
            clients, tasks = _start(cluster, prompts, params, k=1, prefix="pk")

            async def all_on_prefill():
                return sum(w["in_flight"] for w in await _workers(cluster, "prefill")) == 4
            await _until(all_on_prefill, "4 requests held by prefill workers")
            victim, _ = sorted(await _workers(cluster, "prefill"),
                                      key=lambda w: -w["in_flight"])
            os.kill(victim["pid"], signal.SIGKILL)
        finally:
            for w in prefill:
                os.kill(w["pid"], signal.SIGCONT)
        await asyncio.gather(*tasks)
        await _pool_restored(cluster, "prefill", 2)
        return clients, victim
    clients, victim = loop_thread.run(go())
    assert victim["in_flight"] >= 2
    assert [c.tokens for c in clients] == expected_tokens(reference, prompts, params)
    assert _count(cluster, "migrations") + _count(cluster, "transfer_retries") > before
    wait_pools_free(loop_thread, cluster)


def test_transfer_timeout_is_retried_elsewhere(cluster, loop_thread, reference):
    prompts = random_prompts(3, seed=13, low=40, high=120)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    retried_before = _count(cluster, "transfer_retries")

    async def go():
        prefill = await _workers(cluster, "prefill")
        stalled = prefill[0]
        os.kill(stalled["pid"], signal.SIGSTOP)  # its transfers time out on the decode side
        try:
            # Make the stalled worker the only choice, then give the retries somewhere to go.
            others = [w for w in prefill if w is not stalled]
            for w in others:
                cluster.workers[w["worker_id"]].state = "draining"
            clients, tasks = _start(cluster, prompts, params, k=1, prefix="tt")

            async def held():
                return next(w for w in await _workers(cluster, "prefill")
                            if w["worker_id"] == stalled["worker_id"])["in_flight"] == 3
            await _until(held, "3 requests held by the stalled prefill worker")
            for w in others:
                cluster.workers[w["worker_id"]].state = "ready"
            await asyncio.gather(*tasks)
        finally:
            os.kill(stalled["pid"], signal.SIGCONT)
        return clients
    clients = loop_thread.run(go())
    assert [c.tokens for c in clients] == expected_tokens(reference, prompts, params)
    assert _count(cluster, "transfer_retries") - retried_before == 3
    wait_pools_free(loop_thread, cluster)


def test_stalled_worker_is_slow_not_dead(cluster, loop_thread, reference):
    prompt = random_prompts(1, seed=14, low=40, high=120)[0]
    migrated_before = _count(cluster, "migrations")

    async def go():
        [client], [task] = _start(cluster, [prompt], LONG, k=3, prefix="st")
        await client.ready.wait()
        worker = next(w for w in await _workers(cluster, "decode") if w["in_flight"])
        os.kill(worker["pid"], signal.SIGSTOP)
        try:
            async def state_is(state):
                return next(w for w in await _workers(cluster, "decode")
                            if w["worker_id"] == worker["worker_id"])["state"] == state
            await _until(lambda: state_is("slow"), "the stalled worker shown as slow")
        finally:
            os.kill(worker["pid"], signal.SIGCONT)
        await task
        await _until(lambda: state_is("ready"), "the worker ready again")
        return client, worker
    client, worker = loop_thread.run(go())
    assert client.tokens == expected_tokens(reference, [prompt], LONG)[0]
    assert worker["worker_id"] in cluster.workers
    assert _count(cluster, "migrations") == migrated_before
    wait_pools_free(loop_thread, cluster)


def test_undecodable_messages_are_dropped(cluster, loop_thread, reference):
    import zmq

    ctx = zmq.Context()
    try:
        targets = [cluster.pool.endpoint] + [h.info["endpoint"] for h in cluster.workers.values()]
        for endpoint in targets:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(endpoint)
            for junk in (b"", b"\xc1garbage", b"\x81\xa4type\xa6launch"):
                sock.send(junk)
            sock.close()
    finally:
        ctx.term()  # returns once the junk was handed over (linger)
    prompt = random_prompts(1, seed=15, low=40, high=120)[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def go():
        [client], [task] = _start(cluster, [prompt], params, k=1, prefix="junk")
        await task
        return client
    client = loop_thread.run(go())
    assert client.tokens == expected_tokens(reference, [prompt], params)[0]
    assert all(h.state == "ready" for h in cluster.workers.values())
    wait_pools_free(loop_thread, cluster)
