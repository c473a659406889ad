"""Shared fixtures: the tiny and SmolLM2 models, Hugging Face references, pool checks."""

from __future__ import annotations

import functools

import pytest
import torch

from engine import LLMEngine
from engine.model_loader import resolve_model_dir


@functools.cache
def hf_model(name: str) -> torch.nn.Module:
    """The Hugging Face `transformers` implementation on the same weights, fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(name), dtype=torch.float32)
    return model.eval()


def hf_greedy(name: str, prompt_token_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation by `transformers` (argmax each step, EOS not special): the oracle."""
    model = hf_model(name)
    ids = torch.tensor([prompt_token_ids])
    out: list[int] = []
    past = None
    with torch.inference_mode():
        for _ in range(max_tokens):
            result = model(ids, cache=past, use_cache=True)
            past = result.cache
            out.append(int(result.logits[0, -1].argmax()))
            ids = torch.tensor([[out[-1]]])
    return out


def assert_pool_free(engine: LLMEngine) -> None:
    """Nothing running, nothing held: every block back in the free queue."""
    pool = engine.block_pool
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine.scheduler.parked
    assert pool.num_free_blocks == pool.num_blocks
    assert all(count == 0 for count in pool.ref_cnt)


@pytest.fixture(scope="session")
def tiny_dir() -> str:
    return str(resolve_model_dir("tiny"))
