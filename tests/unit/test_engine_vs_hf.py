"""Greedy output must equal Hugging Face `transformers` token for token (fp32, same weights)."""

import random

import pytest
import torch

from engine import LLM, CacheConfig, SamplingParams, SchedulerConfig
from engine.scheduler import Scheduler
from tests.conftest import SMOL_CHATS, assert_pool_free, hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompts(n: int, seed: int, low: int = 3, high: int = 90) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(rng.randint(low, high))]
            for _ in range(n)]


# Eight prompts of 20 to 40 tokens.
PREEMPTED = _prompts(8, seed=5, low=20, high=40)


def _ours_and_hf(llm: LLM, prompts: list[list[int]],
                 params: SamplingParams = GREEDY) -> tuple[list[list[int]], list[list[int]]]:
    """Our greedy tokens and the `transformers` oracle's, prompt by prompt."""
    outputs = llm.generate(prompts, params)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    return ([o.outputs[0].token_ids for o in outputs],
            [hf_greedy("tiny", p, params.max_tokens) for p in prompts])


@pytest.mark.parametrize("chunked", [True, False])
def test_tiny_batch_mix_matches_hf(chunked):
    sched = SchedulerConfig(max_num_batched_tokens=64 if chunked else 128,
                            enable_chunked_prefill=chunked)
    llm = LLM("tiny", scheduler=sched, cache=CacheConfig(block_size=8, num_blocks=128))
    ours, expected = _ours_and_hf(llm, _prompts(10, seed=1))
    assert ours == expected
    assert_pool_free(llm.engine)


def test_tiny_chunked_prefill_with_tiny_budget_matches_hf():
    # A budget of 5 tokens splits every prompt across many steps and mixes in decodes.
    # (Four of the preemption test's prompts: their `transformers` tokens are made once.)
    llm = LLM("tiny", scheduler=SchedulerConfig(max_num_batched_tokens=5),
              cache=CacheConfig(block_size=4, num_blocks=256))
    ours, expected = _ours_and_hf(llm, PREEMPTED[:4])
    assert ours == expected
    assert_pool_free(llm.engine)


def test_tiny_prefix_cache_hits_match_hf():
    llm = LLM("tiny", cache=CacheConfig(block_size=4, num_blocks=256))
    shared = _prompts(1, seed=3, low=40, high=40)[0]
    prompts = [shared + tail for tail in _prompts(5, seed=4, low=1, high=12)]
    ours, expected = _ours_and_hf(llm, prompts[:1])
    assert ours == expected
    outputs = llm.generate(prompts, GREEDY)
    assert all(o.num_cached_tokens >= 40 for o in outputs[:1])
    assert all(o.num_cached_tokens >= 36 for o in outputs)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy("tiny", prompt, GREEDY.max_tokens)
    assert_pool_free(llm.engine)


def test_tiny_forced_preemption_matches_hf(monkeypatch):
    # 24 blocks of 4 tokens cannot hold eight ~30-token requests growing by 24 tokens.
    llm = LLM("tiny", cache=CacheConfig(block_size=4, num_blocks=24, enable_prefix_caching=False))
    preempted: list[str] = []
    preempt = Scheduler._preempt
    monkeypatch.setattr(Scheduler, "_preempt", lambda self, request, out: (
        preempted.append(request.request_id), preempt(self, request, out)))
    prompts = PREEMPTED
    outputs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy("tiny", prompt, GREEDY.max_tokens)
    assert llm.engine.block_pool.num_free_blocks == 24
    assert_pool_free(llm.engine)
    assert preempted and llm.engine.stats().num_preemptions == len(preempted)  # the metric's


def test_tiny_static_policy_matches_hf():
    llm = LLM("tiny", scheduler=SchedulerConfig(policy="static", max_num_seqs=3),
              cache=CacheConfig(num_blocks=128))
    # Seven of the batch-mix prompts: their `transformers` tokens are computed once.
    ours, expected = _ours_and_hf(llm, _prompts(10, seed=1)[3:])
    assert ours == expected
    assert_pool_free(llm.engine)


def test_tiny_text_prompts_match_hf():
    llm = LLM("tiny", cache=CacheConfig(num_blocks=32))
    texts = ["Hello, how are you today?", "The quick brown fox", "Once upon a time"]
    outputs = llm.generate(texts, GREEDY)
    for text, out in zip(texts, outputs, strict=True):
        ids = llm.tokenizer.encode(text)
        assert out.prompt_token_ids == ids
        expected = hf_greedy("tiny", ids, GREEDY.max_tokens)
        assert out.outputs[0].token_ids == expected
        assert out.outputs[0].text == llm.tokenizer.decode(expected, skip_special_tokens=True)


@pytest.mark.slow
def test_smollm2_chat_matches_hf(smollm2):
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    conversations = [[{"role": "user", "content": c}] for c in SMOL_CHATS]
    outputs = smollm2.chat(conversations, params)
    for out in outputs:
        assert len(out.outputs[0].token_ids) == 32
        assert out.outputs[0].token_ids == hf_greedy("smollm2", out.prompt_token_ids, 32)
    assert outputs[0].outputs[0].text.startswith("The capital of France is Paris.")
    assert_pool_free(smollm2.engine)


# Logits: bfloat16 keeps 8 significant bits, so on this model (logits up to about 10) it
# moves the gap between two logits by up to about 0.25 (measured on the shared tokens).
BF16_GAP = 0.5


def _top_gap(logprobs: dict[int, float]) -> float:
    first, second = sorted(logprobs.values(), reverse=True)[:2]
    return first - second


def test_tiny_bf16_runs_paged_and_parts_from_fp32_only_at_near_ties():
    """bf16 greedy follows fp32 greedy over all 24 tokens until, if ever, a step where the
    two picks are within BF16_GAP of each other in fp32's logits: rounding may swap a
    near-tie, never a clear winner (after that the contexts differ and nothing is
    compared). Along the shared tokens, every step's top-two gap stays within BF16_GAP of
    fp32's."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=20)
    prompts = _prompts(8, seed=8)
    bf16 = LLM("tiny", dtype="bfloat16", cache=CacheConfig(num_blocks=128))
    assert bf16.engine.kv_cache.buffer.dtype == torch.bfloat16
    out16 = bf16.generate(prompts, params)
    out32 = LLM("tiny", cache=CacheConfig(num_blocks=128)).generate(prompts, params)
    shared = 0
    for o16, o32 in zip(out16, out32, strict=True):
        t16, t32 = o16.outputs[0].token_ids, o32.outputs[0].token_ids
        lp16, lp32 = o16.outputs[0].logprobs, o32.outputs[0].logprobs
        assert len(t16) == len(t32) == params.max_tokens
        parted = next((i for i, (a, b) in enumerate(zip(t16, t32, strict=True))
                       if a != b), len(t32))
        for step in range(parted):
            assert abs(_top_gap(lp16[step]) - _top_gap(lp32[step])) < BF16_GAP, step
        if parted < len(t32):
            assert t16[parted] in lp32[parted], "bf16 picked a token outside fp32's top 20"
            assert lp32[parted][t32[parted]] - lp32[parted][t16[parted]] < BF16_GAP
        shared += parted
    assert shared >= len(prompts) * params.max_tokens // 4  # not a near-tie at every start
    assert_pool_free(bf16.engine)
