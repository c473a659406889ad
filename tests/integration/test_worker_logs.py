"""A worker's JSON log (`serve --log-format json`) on a real cluster: the lines about a request
carry the client's request id, the attempt and the trace id of the W3C `traceparent` it came
with, in the worker process's own log, Ray's `worker-*-<pid>.err` under the session's logs.

Two events on a colocated worker with a small KV pool: a prompt longer than the worker
allows fails there (logged by the worker itself), and requests that outgrow the pool are
preempted (logged by the engine, which knows only the request's id: the worker's
`RequestTraces` adds the trace).
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from engine import SamplingParams
from protocol.logs import LogConfig
from router.backend import GenerateRequest
from tests.integration.conftest import random_prompts, start_cluster, wait_pools_free

pytestmark = pytest.mark.cluster

# 24 blocks of 4 tokens: a 96-token limit, and room for three 30-token prompts, not their
# 24 output tokens each.
WORKER = {"num_blocks": 24, "block_size": 4}
GROW = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
RAY_MARKERS = (":job_id:", ":actor_name:", ":task_name:")


def traceparent(n: int) -> tuple[str, str]:
    trace = f"{n:032x}"
    return trace, f"00-{trace}-00f067aa0ba902b7-01"


@pytest.fixture(scope="module")
def cluster(ray_local, loop_thread):
    backend = start_cluster(loop_thread, mode="colocated", num_decode=1,
                            log=LogConfig("INFO", "json"), worker=WORKER)
    yield backend
    loop_thread.run(backend.close())


def worker_log(backend) -> list[str]:
    """The lines of the worker's log: its process's stderr, Ray's file for it."""
    (handle,) = backend.workers.values()
    path = os.readlink(f"/proc/{handle.info.pid}/fd/2")
    assert path.endswith(f"-{handle.info.pid}.err") and "/logs/worker-" in path
    with open(path) as f:
        return f.read().splitlines()


def records(lines: list[str]) -> list[dict]:
    """Every line is one JSON object, but for the markers Ray writes when an actor starts."""
    return [json.loads(line) for line in lines if not line.startswith(RAY_MARKERS)]


def test_the_workers_json_lines_carry_the_trace_of_the_request(cluster, loop_thread):
    bad_trace, bad_parent = traceparent(0xbad)
    traces = {f"grow{i}": traceparent(i + 1) for i in range(8)}

    async def go():
        too_long = GenerateRequest("too-long", list(range(100, 220)), GROW, time.monotonic(),
                                   bad_parent)
        prompts = random_prompts(8, seed=5, low=30, high=30)
        growing = [GenerateRequest(rid, prompt, GROW, time.monotonic(), traces[rid][1])
                   for rid, prompt in zip(traces, prompts, strict=True)]
        return await asyncio.gather(*(_last(cluster, r) for r in (too_long, *growing)))

    failed, *finished = loop_thread.run(go())
    assert failed.finish_reason == "error" and "ValueError" in failed.error
    assert [last.finish_reason for last in finished] == ["length"] * 8
    wait_pools_free(loop_thread, cluster)

    lines = records(worker_log(cluster))
    (failure,) = [r for r in lines if r.get("request_id") == "too-long"]
    assert (failure["level"], failure["logger"], failure["attempt"], failure["trace_id"]) == \
        ("ERROR", "cluster.worker", 1, bad_trace)
    assert failure["message"].startswith("Generate failed: ValueError: prompt:")
    assert "Traceback" in failure["exception"]
    preempted = [r for r in lines if r["message"].startswith("preempted")]
    assert preempted, "the pool never ran out: no preemption to log"
    for record in preempted:
        assert (record["level"], record["logger"]) == ("INFO", "engine.llm_engine")
        assert record["trace_id"] == traces[record["request_id"]][0]
        assert record["attempt"] == 1


async def _last(backend, request: GenerateRequest):
    async for delta in backend.generate(request):
        last = delta
    return last
