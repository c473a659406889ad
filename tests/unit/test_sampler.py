import math

import pytest
import torch

from engine.request import Request
from engine.sampler import sample
from engine.sampling_params import SamplingParams


def _logits() -> torch.Tensor:
    # Token i has logit i/4: a smooth distribution over 32 tokens.
    return (torch.arange(32, dtype=torch.float32) / 4).repeat(2, 1)


def _request(params: SamplingParams, generator: torch.Generator | None = None,
             prompt: tuple[int, ...] = (0,), output: tuple[int, ...] = ()) -> Request:
    request = Request("r", list(prompt), params)
    request.generator = generator
    request.output_token_ids = list(output)
    return request


def _draw(params: SamplingParams, n: int, seed: int = 0) -> list[int]:
    request = _request(params, torch.Generator().manual_seed(seed))
    return [sample(_logits()[:1], [request]).token_ids[0] for _ in range(n)]


def test_greedy_is_argmax():
    out = sample(_logits(), [_request(SamplingParams(temperature=0))] * 2)
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
    out = sample(_logits()[:1], [_request(SamplingParams(temperature=0, logprobs=2))])
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
    ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
    ("frequency_penalty", -3, "frequency_penalty must be in [-2, 2]"),
    ("repetition_penalty", 0.0, "repetition_penalty must be > 0"),
    ("logit_bias", {"5": 101}, "logit_bias[5] must be in [-100, 100]"),
    ("logit_bias", {"x": 1}, "logit_bias must map token ids to numbers"),
    ("json_schema", "{not json", "json_schema: not valid JSON"),
    ("json_schema", "[1]", "json_schema: must be a JSON Schema object"),
])
def test_bad_sampling_params_name_the_field(field, value, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)


def _greedy_after(logits: torch.Tensor, **kwargs) -> int:
    prompt, output = kwargs.pop("prompt", (0,)), kwargs.pop("output", ())
    request = _request(SamplingParams(temperature=0, **kwargs), prompt=prompt, output=output)
    return sample(logits[None], [request]).token_ids[0]


def test_logit_bias_is_added_to_the_logit():
    logits = _logits()[0]  # token 31 leads token 27 by exactly 1.0
    assert _greedy_after(logits, logit_bias={"27": 0.99}) == 31
    assert _greedy_after(logits, logit_bias={"27": 1.01}) == 27
    assert _greedy_after(logits, logit_bias={31: -100}) == 30


def test_frequency_and_presence_penalties_follow_openai_definition():
    logits = _logits()[0]  # gaps of 0.25 between neighbours
    # Token 31 seen twice: frequency 0.2 costs it 0.4 > 0.25, so 30 wins; 0.1 costs 0.2.
    assert _greedy_after(logits, output=(31, 31), frequency_penalty=0.2) == 30
    assert _greedy_after(logits, output=(31, 31), frequency_penalty=0.1) == 31
    # Presence counts once however often the token appeared.
    assert _greedy_after(logits, output=(31, 31, 31), presence_penalty=0.3) == 30
    assert _greedy_after(logits, output=(31, 31, 31), presence_penalty=0.2) == 31
    # Prompt tokens do not count for either.
    assert _greedy_after(logits, prompt=(31,), presence_penalty=2.0) == 31


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([-1.0, 2.0, 1.5, -0.5])
    # 2.0 / 1.5 = 1.33 < 1.5: token 2 wins once token 1 was seen (in the prompt or output).
    assert _greedy_after(logits, prompt=(1,), repetition_penalty=1.5) == 2
    assert _greedy_after(logits, output=(1,), repetition_penalty=1.2) == 1  # 1.67 > 1.5
    only_negative = torch.tensor([-1.0, -2.0, -1.2])
    # -1.0 * 1.5 = -1.5 < -1.2: the seen token drops below token 2.
    assert _greedy_after(only_negative, prompt=(0,), repetition_penalty=1.5) == 2


def test_processing_leaves_other_rows_and_raw_logprobs_alone():
    logits = _logits()
    biased = _request(SamplingParams(temperature=0, logit_bias={0: 100}, logprobs=0))
    plain = _request(SamplingParams(temperature=0))
    out = sample(logits, [biased, plain])
    assert out.token_ids == [0, 31]
    raw = torch.log_softmax(logits[0], dim=-1)[0].item()
    assert math.isclose(out.logprobs[0][0], raw, rel_tol=1e-6)


def test_params_survive_the_msgpack_round_trip_to_a_worker():
    from protocol import Generate, WireSamplingParams, decode_command, encode

    params = SamplingParams(logit_bias={"7": -3.5, 2: 1}, presence_penalty=0.5,
                            json_schema='{"type": "object"}', stop=["x"])
    wire = decode_command(encode(Generate(request_id="r", prompt_token_ids=[1],
                                          params=WireSamplingParams.from_params(params))))
    assert wire.params.to_params() == params
    assert params.logit_bias == ((2, 1), (7, -3.5))
