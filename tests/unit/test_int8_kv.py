"""The int8 KV cache in the engine: SmolLM2's greedy output against fp32 KV, prefix caching
unchanged, the pool's size at a budget, and what the engine reports."""

import pytest
import torch

from engine import LLM, CacheConfig, LLMEngine, SamplingParams
from tests.conftest import assert_pool_free

CHATS = ["What is the capital of France?", "Write a haiku about the sea.",
         "Explain photosynthesis in one paragraph.", "List three prime numbers.",
         "Who wrote Hamlet?", "Translate 'good morning' into Spanish.",
         "What is 12 times 12?", "Give me a tip for learning to code."]
# Measured on these chats over 48 tokens: int8 parted from fp32 only where fp32's top two
# were within 0.12 of each other (3 of 8 chats, at tokens 1, 15 and 17), and along the
# shared tokens the top-two gap moved by at most 0.58.
TIE_GAP = 0.25
GAP_SHIFT = 1.0


def _top_gap(logprobs: dict[int, float]) -> float:
    first, second = sorted(logprobs.values(), reverse=True)[:2]
    return first - second


@pytest.fixture(scope="module")
def smollm2_int8() -> LLM:
    return LLM("smollm2", kv_cache_dtype="int8", cache=CacheConfig(num_blocks=128))


def test_int8_greedy_follows_fp32_kv_up_to_near_ties(smollm2, smollm2_int8):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=20)
    chats = [[{"role": "user", "content": c}] for c in CHATS]
    assert smollm2_int8.engine.kv_cache.buffer.dtype == torch.int8
    out8, out32 = smollm2_int8.chat(chats, params), smollm2.chat(chats, params)
    identical = 0
    for o8, o32 in zip(out8, out32, strict=True):
        t8, t32 = o8.outputs[0].token_ids, o32.outputs[0].token_ids
        lp8, lp32 = o8.outputs[0].logprobs, o32.outputs[0].logprobs
        parted = next((i for i, (a, b) in enumerate(zip(t8, t32, strict=True)) if a != b),
                      len(t32))
        for step in range(parted):
            assert abs(_top_gap(lp8[step]) - _top_gap(lp32[step])) < GAP_SHIFT, step
        if parted < len(t32):
            assert t8[parted] in lp32[parted], "int8 picked a token outside fp32's top 20"
            assert lp32[parted][t32[parted]] - lp32[parted][t8[parted]] < TIE_GAP
        identical += parted == len(t32)
    assert identical >= len(CHATS) // 2  # 5 of 8 measured
    assert out8[0].outputs[0].text.startswith("The capital of France is Paris.")
    # Prefix caching unchanged: the prompts' int8 blocks now come from the cache, and a
    # prompt attends its fresh keys as stored, so the tokens are the same.
    again = smollm2_int8.chat(chats[:3], params)
    assert smollm2_int8.engine.block_pool.num_hits > 0
    assert [o.outputs[0].token_ids for o in again] == \
        [o.outputs[0].token_ids for o in out8[:3]]
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
