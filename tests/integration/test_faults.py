"""Fault injection on a local Ray cluster: real SIGKILL / SIGSTOP of worker processes.

Every scenario ends with every request answered and every worker's KV pool fully free.
Faults are timed on observable events (a stream has yielded k tokens, a worker holds
requests, status shows a state), never on sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from cluster.handle import WorkerHandle
from engine import SamplingParams
from protocol import Role
from router.backend import GenerateRequest
from tests.integration.conftest import (
    expected_tokens,
    random_prompts,
    start_cluster,
    wait_pools_free,
)

pytestmark = pytest.mark.cluster

LONG = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True)
# Penalties count the tokens streamed before a migration; the grammar's state follows them.
PENALIZED = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True,
                           frequency_penalty=0.8, presence_penalty=0.4, repetition_penalty=1.3)
STRUCTURED = SamplingParams(temperature=0.0, max_tokens=160, frequency_penalty=0.5,
                            json_schema=json.dumps({"type": "array",
                                                    "items": {"type": "string"}}))
DRAIN_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def cluster(ray_local, loop_thread):
    # Short KV waits so a stalled prefill worker turns into a transfer failure quickly; a
    # short drain so a drained worker's requests move soon.
    backend = start_cluster(loop_thread, num_prefill=2, num_decode=2,
                            drain_timeout_s=DRAIN_TIMEOUT_S,
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
    """Stream every prompt (with `params`, or one SamplingParams each) in the background."""
    clients = [_Client(f"{prefix}{i}", k) for i in range(len(prompts))]
    each = params if isinstance(params, list) else [params] * len(prompts)
    tasks = [asyncio.ensure_future(_consume(backend, c, p, sp))
             for c, p, sp in zip(clients, prompts, each, strict=True)]
    return clients, tasks


def _handles(backend, role: Role) -> list[WorkerHandle]:
    return [h for h in backend.workers.values() if h.role == role]


@contextlib.contextmanager
def _placing_only_on(backend, chosen: WorkerHandle) -> Iterator[None]:
    """New requests go to `chosen`: the other workers of its pool show as draining."""
    others = [h for h in _handles(backend, chosen.role) if h is not chosen]
    for h in others:
        h.state = "draining"
    try:
        yield
    finally:
        for h in others:
            h.state = "ready"


def _expected_each(reference, prompts, params) -> list[list[int]]:
    return [expected_tokens(reference, [p], sp)[0] for p, sp in zip(prompts, params, strict=True)]


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
    """Six streams on one decode worker (four greedy, one with penalties, one with a JSON
    schema) each have tokens when it is stopped and killed: each is placed again exactly
    once (the counter), and every stream ends with the engine's tokens, the penalty counts
    and the grammar's state carried over with the tokens already streamed.

    The six must decode in step, or a fast one could finish before a slow one has its
    tokens: the worker is stopped while they are placed (short prompts, prefilled where
    they decode, so placing needs no answer from it), so its first step after SIGCONT
    takes all six and every later step gives each one token."""
    prompts = random_prompts(6, seed=11, low=4, high=8)
    params = [LONG] * 4 + [PENALIZED, STRUCTURED]
    expected = _expected_each(reference, prompts, params)
    # The penalties change the answer (there is something to carry over).
    assert expected[4] != expected_tokens(reference, prompts[4:5], LONG)[0]
    migrated_before = _count(cluster, "migrations")
    retried_before = _count(cluster, "transfer_retries")

    async def go():
        victim = _handles(cluster, Role.DECODE)[0]
        with _placing_only_on(cluster, victim):
            os.kill(victim.info.pid, signal.SIGSTOP)
            clients, tasks = _start(cluster, prompts, params, k=3, prefix="dk")

            async def all_placed():
                return len(victim.in_flight) == len(clients)
            await _until(all_placed, "all six placed on the stopped worker")
            os.kill(victim.info.pid, signal.SIGCONT)
            await asyncio.gather(*(c.ready.wait() for c in clients))
        os.kill(victim.info.pid, signal.SIGSTOP)  # nothing finishes after this count
        held = {rid: len(cluster.dispatcher.requests[rid].generated)
                for rid in victim.in_flight}
        os.kill(victim.info.pid, signal.SIGKILL)
        await asyncio.gather(*tasks)
        await _pool_restored(cluster, "decode", 2)
        return clients, victim.worker_id, held
    clients, victim, held = loop_thread.run(go())
    assert sorted(held) == [c.rid for c in clients]
    assert all(3 <= n < 160 for n in held.values()), held  # all decoding, none at its end
    assert [c.tokens for c in clients] == expected
    assert [c.last.finish_reason for c in clients] == ["length"] * 6
    assert _count(cluster, "migrations") - migrated_before == 6
    assert _count(cluster, "transfer_retries") == retried_before
    assert victim not in cluster.workers
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
        os.kill(victim.info.pid, signal.SIGKILL)

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
    migrated_before = _count(cluster, "migrations")
    retried_before = _count(cluster, "transfer_retries")

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
    assert [c.tokens for c in clients] == expected_tokens(reference, prompts, params)
    # Each request the dead worker held was placed again once, as a migration (its death
    # was seen long before the decode side's 4 s KV wait could call it a transfer failure);
    # the stalled survivor's requests simply went on.
    assert _count(cluster, "migrations") - migrated_before == victim["in_flight"]
    assert _count(cluster, "transfer_retries") == retried_before
    assert victim["worker_id"] not in cluster.workers
    wait_pools_free(loop_thread, cluster)


def test_transfer_timeout_is_retried_elsewhere(cluster, loop_thread, reference):
    prompts = random_prompts(3, seed=13, low=40, high=120)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    retried_before = _count(cluster, "transfer_retries")
    migrated_before = _count(cluster, "migrations")

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
    assert _count(cluster, "migrations") == migrated_before  # retries are not migrations
    wait_pools_free(loop_thread, cluster)


def test_a_drained_workers_requests_move_when_the_drain_timeout_expires(
        cluster, loop_thread, reference):
    """Scaling the decode pool 2 -> 1 drains the less busy worker (2 requests against 4).
    It is stopped (SIGSTOP), so they cannot finish there: they stay until the drain timeout
    expires, then move to the other worker, each counted once as a migration, and end with
    the engine's tokens; the drained worker is then stopped for good."""
    prompts = random_prompts(6, seed=17, low=40, high=120)
    migrated_before = _count(cluster, "migrations")

    async def go():
        stays, drained = _handles(cluster, Role.DECODE)
        with _placing_only_on(cluster, stays):
            clients, tasks = _start(cluster, prompts[:4], LONG, k=3, prefix="dt")
            await asyncio.gather(*(c.ready.wait() for c in clients))
        with _placing_only_on(cluster, drained):
            more, more_tasks = _start(cluster, prompts[4:], LONG, k=3, prefix="dd")
            await asyncio.gather(*(c.ready.wait() for c in more))
        os.kill(drained.info.pid, signal.SIGSTOP)
        try:
            held = sorted(drained.in_flight)
            asked = time.monotonic()
            await cluster.scale(num_prefill=None, num_decode=1)
            assert drained.state == "draining" and stays.state == "ready"
            assert _count(cluster, "migrations") == migrated_before  # not before the timeout

            async def moved():
                return _count(cluster, "migrations") - migrated_before == len(held)
            await _until(moved, "the drained worker's requests to move")
            waited = time.monotonic() - asked
        finally:
            os.kill(drained.info.pid, signal.SIGCONT)
        await asyncio.gather(*tasks, *more_tasks)

        async def gone():
            return drained.worker_id not in cluster.workers
        await _until(gone, "the drained worker stopped")
        await cluster.scale(num_prefill=None, num_decode=2)  # as the other tests expect
        return clients + more, held, waited
    clients, held, waited = loop_thread.run(go())
    assert held == ["dd0", "dd1"]
    assert waited >= DRAIN_TIMEOUT_S
    assert [c.tokens for c in clients] == expected_tokens(reference, prompts, LONG)
    assert [c.last.finish_reason for c in clients] == ["length"] * 6
    assert _count(cluster, "migrations") - migrated_before == 2
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
        targets = [cluster.pool.endpoint] + [h.info.endpoint for h in cluster.workers.values()]
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
