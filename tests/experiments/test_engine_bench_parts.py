"""The engine benchmark's workload, its `transformers` static-batching peer and its ratios."""

import pytest

from experiments.hf_peer import generate_static
from experiments.workloads import Workload, uniform, w_mixed
from tests.conftest import hf_greedy, hf_model


def test_w_mixed_is_seeded_and_in_range(tmp_path):
    workload = w_mixed()
    assert len(workload.requests) == 64
    assert all(32 <= len(r.prompt_token_ids) <= 512 and 16 <= r.max_tokens <= 128
               for r in workload.requests)
    assert all(100 <= t < 49052 for r in workload.requests for t in r.prompt_token_ids)
    assert w_mixed().requests == workload.requests
    assert w_mixed(seed=1).requests != workload.requests
    # Smoke runs are a prefix of the real workload.
    assert w_mixed(num_requests=5).requests == workload.requests[:5]
    workload.save(tmp_path / "w.json")
    assert Workload.load(tmp_path / "w.json") == workload


def test_bad_workload_arguments():
    with pytest.raises(ValueError, match="prompt_len"):
        w_mixed(prompt_len=(10, 5))
    with pytest.raises(ValueError, match="num_requests"):
        w_mixed(num_requests=0)


def test_static_batches_match_one_by_one_greedy():
    requests = [{"prompt_token_ids": r.prompt_token_ids, "max_tokens": r.max_tokens}
                for r in uniform(3, 12, 6).requests]
    requests.append({"prompt_token_ids": [500, 501, 502], "max_tokens": 9})
    outputs = generate_static(hf_model("tiny"), requests, batch_size=2, pad_token_id=0)
    for request, tokens in zip(requests, outputs, strict=True):
        assert tokens == hf_greedy("tiny", request["prompt_token_ids"], request["max_tokens"])


def test_vllms_best_is_the_faster_of_its_thread_settings_and_dtypes():
    from experiments.engine_bench import ratios

    def run(tok_s: float) -> dict[str, float]:
        return {"output_tok_s": tok_s, "total_tok_s": 2 * tok_s}

    engines = {"pdcluster-float32": run(60), "vllm-float32": run(50),
               "vllm_all-float32": run(40), "pdcluster-bfloat16": run(240),
               "vllm-bfloat16": run(160), "vllm_all-bfloat16": run(200), "hf": run(30)}
    out = ratios(engines)
    assert out["best: pdcluster-bfloat16/vllm_all-bfloat16"]["output_tok_s"] == 1.2
    assert out["pdcluster-bfloat16/vllm-bfloat16"]["total_tok_s"] == 1.5
    assert out["pdcluster-float32/vllm_all-float32"]["output_tok_s"] == 1.5
    assert out["pdcluster-float32/hf"]["output_tok_s"] == 2.0
    assert len(out) == 6
