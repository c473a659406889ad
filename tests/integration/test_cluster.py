"""The disaggregated path on a local Ray cluster: exact tokens, concurrency, abort, scaling."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from cluster.handle import WorkerHandle
from engine import SamplingParams
from tests.integration.conftest import (
    collect,
    collect_all,
    expected_tokens,
    random_prompts,
    start_cluster,
    wait_pools_free,
)

pytestmark = pytest.mark.cluster

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def disagg(ray_local, loop_thread):
    backend = start_cluster(loop_thread, num_prefill=1, num_decode=1)
    yield backend
    loop_thread.run(backend.close())


@pytest.fixture(scope="module")
def colocated(ray_local, loop_thread):
    backend = start_cluster(loop_thread, mode="colocated", num_decode=1)
    yield backend
    loop_thread.run(backend.close())


def test_disaggregated_greedy_equals_engine_and_colocated(disagg, colocated, loop_thread,
                                                          reference):
    prompts = random_prompts(6, seed=1, low=20, high=200)
    expected = [o.outputs[0].token_ids for o in reference.generate(prompts, GREEDY)]
    got = collect_all(loop_thread, disagg, prompts, GREEDY, "d")
    assert [tokens for tokens, _ in got] == expected
    # Long prompts went through the prefill worker and the KV transfer.
    assert all("prefill" in last.timings and "transfer" in last.timings for _, last in got)
    got_colocated = collect_all(loop_thread, colocated, prompts, GREEDY, "c")
    assert [tokens for tokens, _ in got_colocated] == expected
    # `auto` internal security on one node's loopback: plain TCP, as `serve` announces it.
    assert colocated.internal_security.startswith("plain TCP")
    wait_pools_free(loop_thread, disagg)
    wait_pools_free(loop_thread, colocated)


def test_short_prompt_is_prefilled_on_the_decode_worker(disagg, loop_thread, reference):
    prompt = [101, 102, 103]
    tokens, last = loop_thread.run(collect(disagg, "short", prompt, GREEDY))
    assert tokens == reference.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert "prefill" not in last.timings
    wait_pools_free(loop_thread, disagg)


def test_32_concurrent_streams_complete(disagg, loop_thread, reference):
    prompts = random_prompts(32, seed=2, low=5, high=120)
    got = collect_all(loop_thread, disagg, prompts, GREEDY, "c32-")
    expected = [o.outputs[0].token_ids for o in reference.generate(prompts, GREEDY)]
    assert [tokens for tokens, _ in got] == expected
    assert all(last.finish_reason == "length" for _, last in got)
    wait_pools_free(loop_thread, disagg)


def test_abort_mid_stream_frees_blocks_on_both_workers(disagg, loop_thread):
    params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)

    async def go():
        tokens, finish = [], None
        async for delta in disagg.generate(_request("abort-me", random_prompts(1, 3)[0], params)):
            tokens.extend(delta.token_ids)
            if len(tokens) >= 5 and finish is None:
                assert await disagg.abort("abort-me")
                finish = "sent"
            if delta.finish_reason:
                return tokens, delta.finish_reason
    tokens, reason = loop_thread.run(go())
    assert reason == "abort" and 5 <= len(tokens) < 500
    assert not loop_thread.run(disagg.abort("no-such-request"))
    wait_pools_free(loop_thread, disagg)


def test_scale_up_and_down_under_load_loses_nothing(disagg, loop_thread, reference):
    prompts = random_prompts(16, seed=4, low=20, high=200)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)

    async def go():
        status = await disagg.scale(num_prefill=2, num_decode=2)
        assert len(status["pools"]["prefill"]) == 2 and len(status["pools"]["decode"]) == 2
        decode = [h for h in disagg.workers.values() if h.role == "decode"]
        jobs = [asyncio.ensure_future(collect(disagg, f"s{i}", p, params))
                for i, p in enumerate(prompts)]
        # Every stream placed. Waiting for first tokens instead raced: the tiny model can
        # finish one worker's streams before the last stream's prefill is done.
        while sum(len(h.in_flight) for h in decode) < len(prompts):
            await asyncio.sleep(0.02)
        # No await between this snapshot and the drain choice: nothing finishes in between.
        busy = {h.worker_id: len(h.in_flight) for h in decode}
        await disagg.scale(num_prefill=1, num_decode=1)
        drained = [h.worker_id for h in decode if h.state == "draining"]
        return busy, drained, await asyncio.gather(*jobs)
    busy, drained, got = loop_thread.run(go())
    # The drained decode worker held requests when it was told to go; they all finished.
    assert len(drained) == 1 and busy[drained[0]] > 0
    expected = [o.outputs[0].token_ids for o in reference.generate(prompts, params)]
    assert [tokens for tokens, _ in got] == expected
    assert all(last.finish_reason == "length" for _, last in got)

    async def settled():
        while any(h.state == "draining" for h in disagg.workers.values()):
            await asyncio.sleep(0.05)
        return await disagg.status()
    status = loop_thread.run(settled())
    assert len(status["pools"]["prefill"]) == 1 and len(status["pools"]["decode"]) == 1
    wait_pools_free(loop_thread, disagg)


def test_a_rebalance_changes_worker_roles_in_place(disagg, loop_thread, reference):
    """1P+1D -> 0P+2D -> 1P+1D under load: the same two processes serve throughout (each
    move drains a worker that holds requests, then changes its role; nothing starts), a
    decode worker is always ready, every stream finishes with the engine's tokens, and the
    swapped roles work: prompts prefilled remotely after the moves land exactly.

    The pool that shrinks is stopped (SIGSTOP) from before its requests arrive until its
    worker's drain has begun, so that worker holds requests when the move starts, however
    fast the machine (a tiny model's prefill can end between two polls)."""
    import os
    import signal

    first = random_prompts(8, seed=6, low=40, high=200)
    second = random_prompts(8, seed=26, low=40, high=200)
    after = random_prompts(4, seed=16, low=40, high=200)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)

    def ready(role):
        return sum(1 for h in disagg.workers.values() if h.role == role and h.state == "ready")

    def processes():
        return {h.worker_id: (h.info.pid, str(h.role)) for h in disagg.workers.values()}

    def busy(role):  # requests held by the least busy worker of the pool
        return min(len(h.in_flight) for h in disagg.workers.values() if h.role == role)

    def stop(role):
        pids = [h.info.pid for h in disagg.workers.values() if h.role == role]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        return pids

    async def move(pids, role, prefill, decode):
        """Once every worker of `role` holds a request, resize; let the stopped workers go
        on once one of them drains."""
        try:
            while busy(role) == 0:
                await asyncio.sleep(0.02)
            moving = asyncio.ensure_future(disagg.scale(num_prefill=prefill, num_decode=decode))
            draining = len(held)
            while len(held) == draining and not moving.done():
                await asyncio.sleep(0.01)
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        await moving

    before = processes()
    seen = [(ready("prefill"), ready("decode"))]
    held: list[int] = []  # requests each moved worker held when its drain began

    class Traced(WorkerHandle):
        """Records the ready workers of each pool after every change of a state or role
        (the whole sequence, however briefly one lasted), and what a worker holds when it
        starts to drain."""

        def __setattr__(self, name, value):
            if name == "state" and value == "draining":
                held.append(len(self.in_flight))
            super().__setattr__(name, value)
            if name in ("state", "role"):
                seen.append((ready("prefill"), ready("decode")))

    async def go():
        for h in disagg.workers.values():
            h.__class__ = Traced
        stopped = stop("prefill")
        jobs = [asyncio.ensure_future(collect(disagg, f"rb{i}", p, params))
                for i, p in enumerate(first)]
        await move(stopped, "prefill", 0, 2)
        both_decode = processes()
        stopped = stop("decode")
        jobs += [asyncio.ensure_future(collect(disagg, f"rc{i}", p, params))
                 for i, p in enumerate(second)]
        await move(stopped, "decode", 1, 1)
        for h in disagg.workers.values():
            h.__class__ = WorkerHandle
        got = await asyncio.gather(*jobs)
        swapped = await asyncio.gather(*(collect(disagg, f"ra{i}", p, params)
                                         for i, p in enumerate(after)))
        return got, both_decode, swapped
    got, both_decode, swapped = loop_thread.run(go())
    assert len(held) == 2 and all(n >= 1 for n in held)  # each held requests as it began
    assert {pid for pid, _ in both_decode.values()} == {pid for pid, _ in before.values()}
    assert sorted(role for _, role in both_decode.values()) == ["decode", "decode"]
    assert sorted(role for _, role in processes().values()) == ["decode", "prefill"]
    assert {pid for pid, _ in processes().values()} == {pid for pid, _ in before.values()}
    assert seen[0] == (1, 1) and (0, 2) in seen and seen[-1] == (1, 1)
    assert all(decode >= 1 for _, decode in seen)
    assert [tokens for tokens, _ in got] == expected_tokens(reference, first + second, params)
    assert [tokens for tokens, _ in swapped] == expected_tokens(reference, after, params)
    assert all("transfer" in last.timings for _, last in swapped)  # prefilled remotely
    wait_pools_free(loop_thread, disagg)


def test_a_worker_that_joins_the_decode_pool_takes_half_its_running_requests(
        disagg, loop_thread, reference):
    """1P+1D -> 0P+2D with 9 answers decoding on the one decode worker: the worker moved in
    takes 4 of them (each recomputes its prompt and the tokens already streamed), every
    stream ends with the engine's tokens, and both pools end free. A seeded sample with the
    most output left stays (a move would restart its random stream): its tokens are those
    of an undisturbed run on the same path. The busy worker is stopped (SIGSTOP) from the
    first token of every stream until the move is done, so no stream can finish before it
    and the counts are exact."""
    import os
    import signal

    prompts = random_prompts(9, seed=36, low=20, high=40)
    greedy = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=300, ignore_eos=True)
    params = [greedy] * 8 + [seeded]
    spread_before = disagg.metrics.value("spread_moves")
    got: dict[str, list[int]] = {f"sp{i}": [] for i in range(len(prompts))}

    async def consume(rid, prompt, params):
        async for delta in disagg.generate(_request(rid, prompt, params)):
            got[rid].extend(delta.token_ids)
        return delta.finish_reason

    async def go():
        (busy,) = [h for h in disagg.workers.values() if h.role == "decode"]
        jobs = [asyncio.ensure_future(consume(*job))
                for job in zip(got, prompts, params, strict=True)]
        while not all(got.values()):
            await asyncio.sleep(0.02)
        os.kill(busy.info.pid, signal.SIGSTOP)
        try:
            await disagg.scale(num_prefill=0, num_decode=2)
            (joined,) = [h for h in disagg.workers.values() if h is not busy]
            deadline = asyncio.get_running_loop().time() + 30
            while len(joined.in_flight) < 4 and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.02)
            held = len(busy.in_flight), len(joined.in_flight), "sp8" in busy.in_flight
        finally:
            os.kill(busy.info.pid, signal.SIGCONT)
        return held, await asyncio.gather(*jobs)
    held, reasons = loop_thread.run(go())
    assert held == (5, 4, True)
    assert disagg.metrics.value("spread_moves") \
        - spread_before == 4
    assert reasons == ["length"] * len(prompts)
    assert list(got.values())[:8] == expected_tokens(reference, prompts[:8], greedy)
    wait_pools_free(loop_thread, disagg)
    loop_thread.run(disagg.scale(num_prefill=1, num_decode=1))
    alone, _ = loop_thread.run(collect(disagg, "sp8-alone", prompts[8], seeded))
    assert got["sp8"] == alone
    wait_pools_free(loop_thread, disagg)


def test_the_autoscaler_rebalances_the_live_cluster_under_running_streams(
        disagg, loop_thread, reference):
    """`serve --autoscale` wired as `cluster.serve` wires it (the recording backend in front
    of the cluster, the policy in its own process, the live scale path) on the 1P+1D
    cluster, with a window that makes the policy's answer certain: 20 requests of 200-token
    prompts and 20 tokens out within its 5 s (4 req/s), TTFT p90 <= 450 ms, at most 2
    workers, the planner tests' synthetic profile. There 1P+1D is predicted at 64 % and
    0P+2D at 96 %, so the decision is to rebalance to 0P+2D.

    Eight streams that arrived after the window are decoding on the decode worker, held
    there (SIGSTOP) through the decision: the prefill worker turns decode under them and
    takes four of them (each recomputed there). Every stream, those of the window too,
    ends with the engine's tokens; the same two processes serve throughout; every pool
    ends free."""
    import os
    import signal
    import time
    from dataclasses import replace

    from prometheus_client import CollectorRegistry

    from cluster.autoscaler import AutoscalerLoop, AutoscalerMetrics, RecordingBackend
    from planner.autoscale_policy import Autoscaler, AutoscalerConfig
    from protocol.serving import Slo
    from tests.planner.test_plan import PROFILE

    profile = replace(PROFILE, model="tiny")
    config = AutoscalerConfig(Slo.parse("ttft_p90_ms=450"), "disaggregated", min_workers=2,
                              max_workers=2, min_prefill=0, window_s=5.0,
                              local_prefill_threshold=disagg.config.local_prefill_threshold,
                              max_num_batched_tokens=512)
    front = RecordingBackend(disagg)
    registry = CollectorRegistry()
    autoscaler = AutoscalerLoop(Autoscaler(config, profile, profile), front,
                                AutoscalerMetrics(registry, "tiny"))
    window_prompts = random_prompts(20, seed=51, low=200, high=200)
    window_params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    live_prompts = random_prompts(8, seed=52, low=20, high=40)
    live_params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    pids = {h.info.pid for h in disagg.workers.values()}
    spread_before = disagg.metrics.value("spread_moves")
    live: dict[str, list[int]] = {f"al{i}": [] for i in range(len(live_prompts))}

    async def consume(rid, prompt):
        async for delta in front.generate(_request(rid, prompt, live_params)):
            live[rid].extend(delta.token_ids)
        return delta.finish_reason

    async def go():
        window = await asyncio.gather(*(collect(front, f"aw{i}", p, window_params)
                                        for i, p in enumerate(window_prompts)))
        now = max(r.timestamp for r in front.seen.values()) + 1e-3  # the window's end
        (decode,) = [h for h in disagg.workers.values() if h.role == "decode"]
        jobs = [asyncio.ensure_future(consume(rid, p))
                for rid, p in zip(live, live_prompts, strict=True)]
        while not all(live.values()):
            await asyncio.sleep(0.02)
        os.kill(decode.info.pid, signal.SIGSTOP)
        try:
            decision = await autoscaler.step(now)
            (joined,) = [h for h in disagg.workers.values() if h is not decode]
            deadline = time.monotonic() + 30
            while len(joined.in_flight) < 4 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            held = len(decode.in_flight), len(joined.in_flight)
        finally:
            os.kill(decode.info.pid, signal.SIGCONT)
        return window, decision, held, await asyncio.gather(*jobs)

    try:
        window, decision, held, reasons = loop_thread.run(go())
    finally:
        autoscaler.close()
    assert (decision.action, decision.prefill, decision.decode) == ("rebalance", 0, 2)
    assert decision.reason.startswith("1P+1D is predicted at 64% attainment at 4.00 req/s; "
                                      "0P+2D is the cheapest split meeting the SLO")
    assert registry.get_sample_value("pdcluster:autoscaler_decisions_total",
                                     {"model_name": "tiny", "action": "rebalance"}) == 1
    assert held == (4, 4)
    assert disagg.metrics.value("spread_moves") - spread_before == 4
    assert sorted(str(h.role) for h in disagg.workers.values()) == ["decode", "decode"]
    assert {h.info.pid for h in disagg.workers.values()} == pids
    assert [tokens for tokens, _ in window] == expected_tokens(reference, window_prompts,
                                                               window_params)
    assert list(live.values()) == expected_tokens(reference, live_prompts, live_params)
    assert reasons == ["length"] * len(live_prompts)
    wait_pools_free(loop_thread, disagg)

    async def back_to_1p1d():  # as the module's other tests expect
        await disagg.scale(num_prefill=1, num_decode=1)
        while any(h.state == "draining" for h in disagg.workers.values()):
            await asyncio.sleep(0.05)
    loop_thread.run(back_to_1p1d())
    assert sorted(str(h.role) for h in disagg.workers.values()) == ["decode", "prefill"]
    wait_pools_free(loop_thread, disagg)


def test_a_deadline_or_a_client_gone_mid_request_frees_both_workers(disagg, loop_thread):
    """Through the front doors over the 1P+1D cluster (docs/reliability.md, "Faults"):

    - an HTTP stream past `--request-timeout` mid-decode: its first chunk is out, then the
      decode worker is stopped (SIGSTOP), so nothing else can end it; it ends with the
      `deadline_exceeded` error event;
    - a gRPC call whose client closes its channel while the prompt is held on the stopped
      prefill worker, the decode worker's blocks reserved for its KV;
    - an HTTP stream whose client leaves after its first chunk, the decode worker stopped
      so the request cannot end first.

    Each is aborted on every worker: the decode worker never runs it to its end, and
    every pool is fully free after."""
    import json
    import os
    import signal
    import threading
    import time

    import grpc
    import httpx
    import ray

    from router.client import PdClusterClient
    from router.router import RouterConfig
    from router.servers import start_servers

    deadline_s, max_tokens = 3.0, 600
    prefill, decode = (next(h for h in disagg.workers.values() if h.role == role)
                       for role in ("prefill", "decode"))
    # Three prompts, none cached anywhere: each is prefilled on the prefill worker.
    prompts = random_prompts(3, seed=41, low=40, high=60)
    servers = loop_thread.run(start_servers(
        disagg, config=RouterConfig(request_timeout_s=deadline_s)))
    router = servers.router
    url = f"http://127.0.0.1:{servers.http_port}/v1/completions"
    body = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True}

    def aborted(cause: str) -> float:
        return router.metrics.registry.get_sample_value(
            "pdcluster:requests_aborted_total",
            {"model_name": router.metrics.model_name, "cause": cause}) or 0.0

    def wait(condition, what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.01)

    def decode_steps() -> int:
        return ray.get(decode.actor.stats.remote(), timeout=30).num_steps

    @contextlib.contextmanager
    def stopped(handle):
        os.kill(handle.info.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(handle.info.pid, signal.SIGCONT)

    def ended_on_every_worker(steps_before: int) -> None:
        wait(lambda: not router.admission.num_running, "the router to end the request")
        wait_pools_free(loop_thread, disagg)
        assert not prefill.in_flight and not decode.in_flight
        assert decode_steps() - steps_before < max_tokens // 2  # not run to its end

    try:
        # The deadline, mid-decode.
        steps, expired = decode_steps(), aborted("deadline")
        with httpx.stream("POST", url, json={**body, "prompt": prompts[0]}, timeout=60) as resp:
            lines = (line for line in resp.iter_lines() if line.startswith("data: "))
            events = [next(lines)]
            with stopped(decode):
                events += list(lines)
        assert json.loads(events[0][6:])["choices"][0]["text"], events[0]
        assert json.loads(events[-2][6:])["error"]["code"] == "deadline_exceeded"
        assert events[-1] == "data: [DONE]"
        assert aborted("deadline") == expired + 1
        ended_on_every_worker(steps)

        # A gRPC client gone while its prompt waits on the prefill worker.
        steps, gone = decode_steps(), aborted("disconnect")
        client = PdClusterClient(f"127.0.0.1:{servers.grpc_port}", timeout=60)
        errors: list[grpc.RpcError] = []

        def stream() -> None:
            try:
                list(client.generate(prompt_token_ids=prompts[1], request_id="gone-grpc",
                                     max_tokens=max_tokens, temperature=0.0,
                                     ignore_eos=True))
            except grpc.RpcError as e:
                errors.append(e)

        with stopped(prefill):
            caller = threading.Thread(target=stream)
            caller.start()
            wait(lambda: "gone-grpc" in prefill.in_flight and "gone-grpc" in decode.in_flight,
                 "the request held by both workers")
            client.close()  # cancels the call
            caller.join(30)
            wait(lambda: not router.admission.num_running, "the router to see the cancel")
        assert [e.code() for e in errors] == [grpc.StatusCode.CANCELLED]
        assert aborted("disconnect") == gone + 1
        ended_on_every_worker(steps)

        # An HTTP client gone mid-stream.
        steps = decode_steps()
        with contextlib.ExitStack() as stop:
            with httpx.stream("POST", url, json={**body, "prompt": prompts[2]},
                              timeout=60) as resp:
                first = next(line for line in resp.iter_lines() if line.startswith("data: "))
                stop.enter_context(stopped(decode))
            # The connection is closed; the request cannot end any other way.
            wait(lambda: not router.admission.num_running, "the router to see the client go")
        assert json.loads(first[6:])["choices"][0]["text"]
        assert aborted("disconnect") == gone + 2
        ended_on_every_worker(steps)
    finally:
        loop_thread.run(servers.stop(grace=0.5))


def _request(rid, prompt, params):
    import time

    from router.backend import GenerateRequest
    return GenerateRequest(rid, prompt, params, time.monotonic())


def test_worker_metrics_are_exported(disagg, loop_thread):
    import time

    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from cluster.metrics import WorkerCollector

    collect_all(loop_thread, disagg, random_prompts(4, seed=7, low=20, high=200), GREEDY, "m")
    done = time.monotonic()

    async def utilization_reported():  # stats pushed after the run, with an interval's figures
        while not all(h.stats_at > done and h.stats is not None and h.stats.utilization is not None
                      for h in disagg.workers.values()):
            await asyncio.sleep(0.05)
    loop_thread.run(utilization_reported(), timeout=60)
    registry = CollectorRegistry()
    registry.register(WorkerCollector(disagg, "tiny"))
    families = {f.name: f for f in text_string_to_metric_families(
        generate_latest(registry).decode())}
    roles = {s.labels["role"] for s in families["pdcluster:worker_kv_usage"].samples}
    assert roles == {"prefill", "decode"}
    prefill_tokens = {s.labels["role"]: s.value
                      for s in families["pdcluster:worker_prefill_tokens"].samples}
    assert prefill_tokens["prefill"] > 0
    queries = {s.labels["role"]: s.value
               for s in families["pdcluster:worker_prefix_cache_queries"].samples}
    assert queries["prefill"] >= prefill_tokens["prefill"]  # cache hits are looked up too
    busy = families["pdcluster:worker_busy_fraction"].samples
    assert busy and all(0.0 <= s.value <= 1.0 for s in busy)
    count = [s for s in families["pdcluster:kv_transfer_seconds"].samples
             if s.name.endswith("_count")]
    assert count[0].value >= 4
    # One host: every transfer went over shared memory.
    shipped = {s.labels["transport"]: s.value
               for s in families["pdcluster:kv_transfer_bytes"].samples
               if s.name.endswith("_total")}
    assert set(shipped) == {"shm"} and shipped["shm"] > 0


def test_workers_total_their_steps_by_shape(disagg, loop_thread):
    """The step totals the planner calibrates on (`EngineLoop.step_totals`), exact: a
    5-token prompt prefilled on the decode worker with 4 tokens out is one prompt step
    (5 tokens, 5 x 3 query-key pairs, one request) and 3 batch-1 decode steps attending
    to 6 + 7 + 8 tokens; a 100-token prompt is one prompt step on the prefill worker and
    3 decode steps on the decode worker attending to 101 + 102 + 103 tokens."""
    import ray

    def totals():
        return {str(h.role): ray.get(h.actor.stats.remote(), timeout=30).step_totals
                for h in disagg.workers.values()}

    def grown(before, after):
        return {role: {key: [round(a - b, 9) for a, b in
                             zip(values, before[role].get(key, [0.0] * len(values)),
                                 strict=True)]
                       for key, values in after[role].items()
                       if values[0] != before[role].get(key, [0.0])[0]}
                for role in after}

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    short, long = random_prompts(1, seed=11, low=5, high=5)[0], \
        random_prompts(1, seed=12, low=100, high=100)[0]
    start = totals()
    loop_thread.run(collect(disagg, "steps-short", short, params))
    middle = totals()
    loop_thread.run(collect(disagg, "steps-long", long, params))
    end = totals()

    local, remote = grown(start, middle), grown(middle, end)
    assert local["prefill"] == {}
    assert set(local["decode"]) == {"prompt", "decode_1"}
    steps, seconds, squares, *work = local["decode"]["prompt"]
    assert (steps, work) == (1, [5, 15, 1]) and seconds > 0
    assert squares == pytest.approx(seconds ** 2, abs=2e-9)  # `grown` rounds to 1e-9
    steps, seconds, squares, attended = local["decode"]["decode_1"]
    # Three steps: their squares sum to between a third of the squared sum and all of it.
    assert (steps, attended) == (3, 21) and seconds ** 2 / 3 <= squares <= seconds ** 2
    steps, seconds, squares, *work = remote["prefill"]["prompt"]
    assert (steps, work) == (1, [100, 5050, 1]) and seconds > 0
    assert squares == pytest.approx(seconds ** 2, abs=2e-9)  # `grown` rounds to 1e-9
    assert set(remote["decode"]) == {"decode_1"}
    steps, seconds, squares, attended = remote["decode"]["decode_1"]
    assert (steps, attended) == (3, 306) and seconds ** 2 / 3 <= squares <= seconds ** 2
    wait_pools_free(loop_thread, disagg)
