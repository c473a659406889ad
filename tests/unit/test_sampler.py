import math

import pytest
import torch

from engine.sampler import sample
from engine.sampling_params import SamplingParams


def _logits() -> torch.Tensor:
    # Token i has logit i/4: a smooth distribution over 32 tokens.
    return (torch.arange(32, dtype=torch.float32) / 4).repeat(2, 1)


def _draw(params: SamplingParams, n: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [sample(_logits()[:1], [params], [gen]).token_ids[0] for _ in range(n)]


def test_greedy_is_argmax():
    out = sample(_logits(), [SamplingParams(temperature=0)] * 2, [None, None])
    assert out.token_ids == [31, 31]


def test_same_seed_same_tokens_different_seed_different_tokens():
    params = SamplingParams(temperature=1.0)
    assert _draw(params, 20, seed=1) == _draw(params, 20, seed=1)
    assert _draw(params, 20, seed=1) != _draw(params, 20, seed=2)


def test_top_k_support():
    tokens = set(_draw(SamplingParams(temperature=1.0, top_k=3), 200))
    assert tokens <= {29, 30, 31} and len(tokens) == 3


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.softmax(_logits()[0], dim=-1).flip(0)
    # The top tokens whose mass before each stays below 0.5.
    keep = int((probs.cumsum(0) - probs < 0.5).sum())
    tokens = set(_draw(SamplingParams(temperature=1.0, top_p=0.5), 400))
    assert tokens == set(range(32 - keep, 32))


def test_min_p_drops_unlikely_tokens():
    # p(i) / p(31) = exp((i - 31) / 4) >= 0.5  <=>  i >= 31 - 4 ln 2 ~ 28.2
    tokens = set(_draw(SamplingParams(temperature=1.0, min_p=0.5), 300))
    assert tokens == {29, 30, 31}


def test_logprobs_are_log_softmax_of_raw_logits():
    out = sample(_logits()[:1], [SamplingParams(temperature=0, logprobs=2)], [None])
    expected = torch.log_softmax(_logits()[0], dim=-1)
    assert set(out.logprobs[0]) == {31, 30}
    assert math.isclose(out.logprobs[0][30], expected[30].item(), rel_tol=1e-6)


@pytest.mark.parametrize("field,value,needle", [
    ("max_tokens", 0, "max_tokens must be >= 1"),
    ("temperature", -0.5, "temperature"),
    ("temperature", float("nan"), "temperature"),
    ("top_p", 0.0, "top_p must be in (0, 1]"),
    ("top_p", 1.5, "top_p"),
    ("top_k", -2, "top_k must be >= -1"),
    ("top_k", 2.5, "top_k must be an integer"),
    ("min_p", 2.0, "min_p"),
    ("logprobs", 21, "logprobs"),
    ("seed", -1, "seed"),
])
def test_bad_sampling_params_name_the_field(field, value, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)
