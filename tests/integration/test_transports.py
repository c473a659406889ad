"""The disaggregated path over each KV transport gives the engine's exact tokens: torch
distributed and mooncake (tcp) here; shared memory by tests/integration/test_cluster.py and
test_internal_auth.py, zmq by test_internal_auth.py (its `off` cluster: the same config)."""

from __future__ import annotations

import importlib.util
import random

import pytest

from engine import LLM, CacheConfig, SamplingParams
from tests.integration.conftest import collect_all, start_cluster, wait_pools_free

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


pytestmark = pytest.mark.cluster


@pytest.mark.parametrize("transports", [("torch_dist",), pytest.param(("mooncake",), marks=(
    pytest.mark.skipif(importlib.util.find_spec("mooncake") is None,
                       reason="the mooncake extra is not installed")))], ids=lambda t: t[0])
def test_transport_end_to_end(ray_local, loop_thread, transports):
    rng = random.Random(9)
    prompts = [[rng.randrange(100, 49000) for _ in range(rng.randint(40, 150))]
               for _ in range(4)]
    expected = [o.outputs[0].token_ids for o in
                LLM("tiny", cache=CacheConfig(num_blocks=64)).generate(prompts, GREEDY)]
    backend = start_cluster(loop_thread, num_prefill=1, num_decode=1, transports=transports)
    try:
        got = collect_all(loop_thread, backend, prompts, GREEDY, "t")
        assert [tokens for tokens, _ in got] == expected
        assert all("transfer" in last.timings for _, last in got)
        wait_pools_free(loop_thread, backend)
    finally:
        loop_thread.run(backend.close())
