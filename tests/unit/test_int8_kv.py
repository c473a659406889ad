"""The int8 KV cache in the engine: SmolLM2's greedy output against fp32 KV, prefix caching
unchanged, the pool's size at a budget, and what the engine reports."""

import pytest
import torch

from engine import LLM, CacheConfig, LLMEngine, SamplingParams
from tests.conftest import assert_pool_free

CHATS = ["What is the capital of France?", "Explain photosynthesis in one paragraph.",
         "List three prime numbers.", "Translate 'good morning' into Spanish.",
         "What is 12 times 12?", "Give me a tip for learning to code."]
# int8 KV moves a step's top-two log-prob gap by less than GAP_SHIFT (measured on these
# chats and two more over 48 tokens: at most 0.58), so greedy int8 can part from fp32 only
# where fp32's top two are within that of each other (measured partings: gaps of 0.12 and,
# with oneDNN's fp32 GEMM in the batch, 0.36).
GAP_SHIFT = 1.0


def _top_gap(logprobs: dict[int, float]) -> float:
    first, second = sorted(logprobs.values(), reverse=True)[:2]
    return first - second


def _follows_up_to_a_near_tie(ours, reference) -> bool:
    """`ours` greedy follows `reference` until, if ever, a step where the two picks are
    within GAP_SHIFT in the reference's logits; along the shared tokens the top-two gap
    moves by less than GAP_SHIFT. True when the sequences are identical."""
    t, t_ref = ours.outputs[0].token_ids, reference.outputs[0].token_ids
    lp, lp_ref = ours.outputs[0].logprobs, reference.outputs[0].logprobs
    parted = next((i for i, (a, b) in enumerate(zip(t, t_ref, strict=True)) if a != b),
                  len(t_ref))
    for step in range(parted):
        assert abs(_top_gap(lp[step]) - _top_gap(lp_ref[step])) < GAP_SHIFT, step
    if parted < len(t_ref):
        assert t[parted] in lp_ref[parted], "a pick outside the reference's top 20"
        assert lp_ref[parted][t_ref[parted]] - lp_ref[parted][t[parted]] < GAP_SHIFT
    return parted == len(t_ref)


@pytest.fixture(scope="module")
def smollm2_int8() -> LLM:
    return LLM("smollm2", kv_cache_dtype="int8", cache=CacheConfig(num_blocks=128))


@pytest.mark.slow
def test_int8_greedy_follows_fp32_kv_up_to_near_ties(smollm2, smollm2_int8):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=20)
    chats = [[{"role": "user", "content": c}] for c in CHATS]
    assert smollm2_int8.engine.kv_cache.buffer.dtype == torch.int8
    out8, out32 = smollm2_int8.chat(chats, params), smollm2.chat(chats, params)
    identical = sum(_follows_up_to_a_near_tie(o8, o32)
                    for o8, o32 in zip(out8, out32, strict=True))
    assert identical >= 2  # measured: 3 of 6 with OpenBLAS in the batch, 2 with oneDNN
    assert out8[0].outputs[0].text.startswith("The capital of France is Paris.")
    # Prefix caching unchanged: the prompts' int8 blocks now come from the cache. (Exact
    # equality is not promised: another batch shape sums the linears in another order.)
    hits = smollm2_int8.engine.block_pool.num_hits
    again = smollm2_int8.chat(chats[:3], params)
    assert smollm2_int8.engine.block_pool.num_hits > hits
    for warm, cold in zip(again, out8, strict=False):
        _follows_up_to_a_near_tie(warm, cold)
    assert_pool_free(smollm2_int8.engine)


def test_pool_at_a_budget_and_the_stats():
    budget = CacheConfig(kv_cache_memory_gb=0.01)
    engines = {name: LLMEngine("tiny", dtype, cache=CacheConfig(
        kv_cache_memory_gb=0.01, kv_cache_dtype=kv)) for name, dtype, kv in [
            ("fp32", "float32", "auto"), ("bf16", "bfloat16", "auto"),
            ("int8", "float32", "int8")]}
    blocks = {name: e.kv_cache.num_blocks for name, e in engines.items()}
    stats = engines["int8"].stats()
    assert (stats["dtype"], stats["kv_cache_dtype"], stats["num_blocks"]) == \
        ("float32", "int8", blocks["int8"])
    assert engines["bf16"].stats()["kv_cache_dtype"] == "bfloat16"
    cfg = engines["int8"].model_config
    row = cfg.head_dim + 4  # values and the fp32 scale
    per_block = cfg.num_layers * 2 * budget.block_size * cfg.num_kv_heads * row
    assert blocks["int8"] == int(0.01 * 2**30) // per_block
    assert blocks["int8"] / blocks["fp32"] == pytest.approx(4 * cfg.head_dim / row, rel=0.01)
    assert blocks["int8"] / blocks["bf16"] == pytest.approx(2 * cfg.head_dim / row, rel=0.01)
    assert engines["int8"].kv_cache.buffer.nbytes <= 0.01 * 2**30
