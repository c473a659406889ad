"""int8 KV pages through the disaggregated path: prefill ships int8 pages and their scales
over shared memory or zmq, decode reads them, and the tokens are those of one int8 engine;
status and the metrics tell the KV dtype and the bytes each request shipped."""

from __future__ import annotations

import time

import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cluster.metrics import WorkerCollector
from engine import LLM, CacheConfig, SamplingParams
from tests.integration.conftest import (
    collect_all,
    random_prompts,
    start_cluster,
    wait_pools_free,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
INT8 = {"kv_cache_dtype": "int8"}

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_int8_kv_over_the_transport_gives_the_int8_engine_tokens(ray_local, loop_thread,
                                                                  transport):
    prompts = random_prompts(4, seed=21, low=40, high=150)
    reference = LLM("tiny", kv_cache_dtype="int8", cache=CacheConfig(num_blocks=128))
    expected = [o.outputs[0].token_ids for o in reference.generate(prompts, GREEDY)]
    cfg = reference.engine.model_config
    # one block of every layer: int8 values and an fp32 scale per token and KV head
    block_bytes = cfg.num_layers * 2 * 16 * cfg.num_kv_heads * (cfg.head_dim + 4)
    backend = start_cluster(loop_thread, num_prefill=1, num_decode=1,
                            transports=(transport,), worker=INT8)
    try:
        got = collect_all(loop_thread, backend, prompts, GREEDY, "q")
        assert [tokens for tokens, _ in got] == expected
        assert all("transfer" in last.timings for _, last in got)  # prefilled remotely
        wait_pools_free(loop_thread, backend)
        assert {h.info.block_bytes for h in backend.workers.values()} == {block_bytes}
        # `status` right after the pools drained shows them free: its figures are taken
        # for the call, not the last pushed ones, which may predate the release (here
        # made stale on purpose: a push from mid-request still in flight).
        deadline = time.monotonic() + 20
        while any(h.stats is None for h in backend.workers.values()):  # for the metrics
            assert time.monotonic() < deadline, "no stats pushed by the workers"
            time.sleep(0.1)
        for h in backend.workers.values():
            h.stats = msgspec.structs.replace(h.stats, num_free_blocks=0, num_running=1)
        status = loop_thread.run(backend.status())
        shown = sorted((w["role"], w["kv_cache_dtype"], w["num_blocks"], w["num_free_blocks"],
                        w["num_running"], w["stats_age_s"])
                       for pool in status["pools"].values() for w in pool)
        assert shown == [("decode", "int8", 128, 128, 0, 0.0),
                         ("prefill", "int8", 128, 128, 0, 0.0)]
        registry = CollectorRegistry()
        registry.register(WorkerCollector(backend, "tiny"))
        families = {f.name: f for f in text_string_to_metric_families(
            generate_latest(registry).decode())}
        info = {(s.labels["role"], s.labels["kv_cache_dtype"], s.value)
                for s in families["pdcluster:worker_kv_cache_info"].samples}
        assert info == {("prefill", "int8", 128), ("decode", "int8", 128)}
        per_request = {s.name: s.value
                       for s in families["pdcluster:kv_transfer_request_bytes"].samples
                       if s.labels["transport"] == transport and "bucket" not in s.name}
        blocks = sum(-(-len(p) // 16) for p in prompts)  # nothing cached on decode
        assert per_request == {"pdcluster:kv_transfer_request_bytes_count": 4,
                               "pdcluster:kv_transfer_request_bytes_sum": blocks * block_bytes}
    finally:
        loop_thread.run(backend.close())
