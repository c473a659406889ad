"""Speculative decoding on a disaggregated cluster: the decode worker drafts and verifies
(by prompt lookup, or with a draft model that catches up on each prompt whose KV arrived by
transfer), the prefill worker ignores the setting, output equals the offline engine's and
the acceptance figures reach the status and the metrics."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cluster.metrics import WorkerCollector
from engine import LLM, CacheConfig, SamplingParams
from engine.model_loader import resolve_model_dir
from tests.conftest import truncated_model
from tests.integration.conftest import collect_all, start_cluster, wait_pools_free

pytestmark = pytest.mark.cluster

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2,
                    "prompt_lookup_min": 1})
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("method", ["ngram", "draft-model"])
def test_decode_worker_speculates_and_reports_it(ray_local, loop_thread, reference, tmp_path,
                                                 method):
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 49000) for _ in range(rng.randint(8, 30))] * 3
               for _ in range(4)]
    expected = [o.outputs[0].token_ids for o in reference.generate(prompts, GREEDY)]
    config, draft_block_bytes = NGRAM, 0
    if method == "draft-model":  # the tiny model's first 2 layers, 16-token blocks
        draft = truncated_model(resolve_model_dir("tiny"), tmp_path / "draft", 2)
        config = json.dumps({"method": "draft", "model": str(draft), "num_speculative_tokens": 3})
        draft_block_bytes = 2 * 2 * 16 * 2 * 16 * 4
    speculating = LLM("tiny", speculative_config=config, cache=CacheConfig(num_blocks=256))
    assert [o.outputs[0].token_ids for o in speculating.generate(prompts, GREEDY)] == expected
    offline = speculating.engine.stats()
    backend = start_cluster(loop_thread, num_prefill=1, num_decode=1,
                            worker={"speculative_config": config})
    try:
        got = collect_all(loop_thread, backend, prompts, GREEDY, "s")
        assert [tokens for tokens, _ in got] == expected
        assert all("transfer" in last.timings for _, last in got)  # prefilled remotely
        done = time.monotonic()

        async def stats_after_run():
            while not all(h.stats_at > done and h.stats is not None
                          for h in backend.workers.values()):
                await asyncio.sleep(0.05)
        loop_thread.run(stats_after_run(), timeout=60)
        status = loop_thread.run(backend.status())
        (decode,), (prefill,) = status["pools"]["decode"], status["pools"]["prefill"]
        assert decode["spec_verify_steps"] > 0 and decode["spec_draft_tokens"] > 0
        assert decode["draft_kv_block_bytes"] == draft_block_bytes
        # The decode worker drafted and accepted exactly what one engine does offline with
        # the same setting (drafts depend on each request's own tokens, not the batch).
        figures = ("spec_draft_tokens", "spec_accepted_tokens", "spec_verify_steps")
        assert tuple(decode[k] for k in figures) == tuple(getattr(offline, k) for k in figures)
        # The draft model's drafts are accepted. The random tiny model never repeats
        # itself, so prompt lookup's drafts all miss here (tokens stay exact);
        # tests/unit/test_spec_decode.py shows them accepted on SmolLM2.
        assert (decode["spec_accepted_tokens"] > 0) == (method == "draft-model")
        assert prefill["spec_verify_steps"] == 0
        registry = CollectorRegistry()
        registry.register(WorkerCollector(backend, "tiny"))
        families = {f.name: f for f in text_string_to_metric_families(
            generate_latest(registry).decode())}
        drafted = {s.labels["role"]: s.value
                   for s in families["pdcluster:worker_spec_draft_tokens"].samples}
        assert drafted == {"decode": decode["spec_draft_tokens"], "prefill": 0}
        wait_pools_free(loop_thread, backend)
    finally:
        loop_thread.run(backend.close())
