"""The disaggregated path over each KV transport gives the engine's exact tokens: torch
distributed (gloo) and mooncake (tcp) here, and pools of different tensor-parallel sizes, a
prefill worker on two ranks feeding a decode worker on one and one feeding two, over shared
memory, zmq and mooncake (zmq one to two: tests/integration/test_tensor_parallel_cluster.py),
and two-rank pools with private pages (the GPU layout: each rank its own KV heads, rank 0
mirroring them for the transport) over torch distributed and shared memory; shared memory
between one-rank pools by tests/integration/test_cluster.py and test_internal_auth.py, zmq
by test_internal_auth.py (its `off` cluster: the same config), torch distributed between
one-rank pools on two nodes by tests/multinode."""

from __future__ import annotations

import importlib.util

import pytest

from engine import SamplingParams
from tests.integration.conftest import (
    collect_all,
    expected_tokens,
    random_prompts,
    start_cluster,
    wait_pools_free,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
MOONCAKE = pytest.mark.skipif(importlib.util.find_spec("mooncake") is None,
                              reason="the mooncake extra is not installed")


pytestmark = pytest.mark.cluster


@pytest.mark.parametrize(("transport", "prefill_tp", "decode_tp", "pages"), [
    ("torch_dist", 2, 2, "private"), ("shm", 2, 2, "private"),
    pytest.param("mooncake", 2, 1, "auto", marks=MOONCAKE),
    pytest.param("mooncake", 1, 2, "auto", marks=MOONCAKE), ("shm", 2, 1, "auto"),
    ("shm", 1, 2, "auto"), ("zmq", 2, 1, "auto")], ids=lambda v: str(v))
def test_transport_end_to_end(ray_local, loop_thread, reference, transport, prefill_tp,
                              decode_tp, pages):
    prompts = random_prompts(4, seed=9, low=40, high=150)
    expected = expected_tokens(reference, prompts, GREEDY)
    backend = start_cluster(
        loop_thread, num_prefill=1, num_decode=1, transports=(transport,),
        prefill_worker={"tensor_parallel_size": prefill_tp, "tp_kv_pages": pages},
        decode_worker={"tensor_parallel_size": decode_tp, "tp_kv_pages": pages})
    try:
        sizes = {h.role: h.info.tensor_parallel_size for h in backend.workers.values()}
        assert (sizes["prefill"], sizes["decode"]) == (prefill_tp, decode_tp)
        got = collect_all(loop_thread, backend, prompts, GREEDY, "t")
        assert [tokens for tokens, _ in got] == expected
        assert all("transfer" in last.timings for _, last in got)
        shipped = {sample.labels["transport"] for metric in backend.metrics.registry.collect()
                   for sample in metric.samples
                   if sample.name == "pdcluster:kv_transfer_bytes_total" and sample.value}
        assert shipped == {transport}
        wait_pools_free(loop_thread, backend)
    finally:
        loop_thread.run(backend.close())
