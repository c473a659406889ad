"""Prefill on one engine, copy the KV blocks, decode on another: same tokens as one engine."""

import json
from collections.abc import Iterator

import jsonschema
import pytest
import torch

from engine import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from tests.conftest import assert_pool_free, hf_greedy

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _engine(role: str, num_blocks: int, prefix_caching: bool = True) -> LLMEngine:
    return LLMEngine("tiny", cache=CacheConfig(block_size=4, num_blocks=num_blocks,
                                               enable_prefix_caching=prefix_caching),
                     scheduler=SchedulerConfig(role=role, max_num_batched_tokens=16))


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, LLMEngine]]:
    """One mixed, one prefill and one decode engine for the tests that compare runs: with
    no prefix cache, every run computes its prompt as a fresh engine would (nothing hits
    an earlier run's blocks). Each test leaves their pools free."""
    built = {role: _engine(role, 64, prefix_caching=False)
             for role in ("mixed", "prefill", "decode")}
    yield built
    for engine in built.values():
        assert_pool_free(engine)


def _run_until_idle(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def _prefill_then_hand_over(prefill: LLMEngine, decode: LLMEngine,
                            prompts: dict[str, list[int]], params: SamplingParams
                            ) -> dict[str, int]:
    """Reserve on decode, prefill on prefill, copy the missing blocks, hand over the first
    token; returns each request's first token."""
    first = {}
    for rid, prompt in prompts.items():
        dst = decode.reserve_remote(rid, prompt, params)
        prefill.add_request(rid, prompt, params)
        while rid not in first:  # chunked: several prefill steps
            for out in prefill.step():
                first[rid] = out.new_token_ids[0]
        src = prefill.scheduler.parked[rid].block_ids
        # Only the blocks the decode side lacks are copied.
        skip = dst.num_computed_tokens // 4
        for layer_src, layer_dst in zip(prefill.kv_cache.layers, decode.kv_cache.layers,
                                        strict=True):
            layer_dst[torch.tensor(dst.block_ids[skip:])] = layer_src[torch.tensor(src[skip:])]
        prefill.release(rid)
        decode.complete_remote(rid, first[rid])
    return first


def test_prefill_engine_to_decode_engine_matches_hf():
    prefill, decode = _engine("prefill", 64), _engine("decode", 48)
    # Warm the decode side's prefix cache so its reservation starts with hits.
    shared = list(range(300, 320))
    decode.add_request("warm", [*shared, 7], PARAMS)
    _run_until_idle(decode)
    prompts = {"a": [*shared, 11, 12, 13, 14, 15], "b": list(range(500, 537))}
    first = _prefill_then_hand_over(prefill, decode, prompts, PARAMS)
    assert decode.requests["a"].num_cached_tokens == 20
    tokens = _run_until_idle(decode)
    for rid, prompt in prompts.items():
        assert [first[rid], *tokens[rid]] == hf_greedy("tiny", prompt, PARAMS.max_tokens)
    assert_pool_free(prefill)
    assert_pool_free(decode)


def test_abort_during_remote_reservation_frees_blocks(engines: dict[str, LLMEngine]) -> None:
    decode = engines["decode"]
    decode.reserve_remote("x", list(range(100, 130)), PARAMS)
    assert decode.block_pool.num_free_blocks == 64 - 8
    out = decode.abort_request("x")
    assert out.finish_reason == "abort"
    assert_pool_free(decode)


def test_failed_step_answers_its_requests_with_error_and_frees_blocks():
    import threading

    import pytest

    from engine import EngineStepError
    from engine.engine_loop import EngineLoop

    def broken_hook(layer, schedule):  # a fault inside the step (e.g. a transport error)
        raise RuntimeError("boom")

    engine = _engine("mixed", 32)
    engine.add_request("a", list(range(100, 120)), PARAMS)
    with pytest.raises(EngineStepError, match="boom") as info:
        engine.step(broken_hook)
    assert [(o.request_id, o.finish_reason) for o in info.value.outputs] == [("a", "error")]
    assert_pool_free(engine)

    # Driven by the loop thread, the same failure still reaches the output sink.
    got, done = [], threading.Event()
    loop = EngineLoop(engine, lambda outs: (got.extend(outs), done.set()), broken_hook)
    loop.start()
    try:
        loop.submit(lambda e: e.add_request("b", list(range(200, 220)), PARAMS))
        assert done.wait(30)
    finally:
        loop.stop()
    assert [(o.request_id, o.finish_reason) for o in got] == [("b", "error")]
    assert_pool_free(engine)


def _mixed_and_split(engines: dict[str, LLMEngine], params: SamplingParams
                     ) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Two prompts' tokens on the mixed engine, and prefilled on the prefill engine then
    decoded on the decode engine (the first token from the prefill side); every pool is
    free after."""
    prompts = {"a": list(range(600, 611)), "b": list(range(700, 730))}
    for rid, prompt in prompts.items():
        engines["mixed"].add_request(rid, prompt, params)
    expected = _run_until_idle(engines["mixed"])
    first = _prefill_then_hand_over(engines["prefill"], engines["decode"], prompts, params)
    tokens = _run_until_idle(engines["decode"])
    split = {rid: [first[rid], *tokens[rid]] for rid in prompts}
    for engine in engines.values():
        assert_pool_free(engine)
    return expected, split


def test_logits_processing_carries_over_from_prefill_to_decode(
        engines: dict[str, LLMEngine]) -> None:
    """Grammar, penalties and bias give the same tokens split over two roles as on one: the
    decode side's grammar matcher and penalty counts include the prefill's first token."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "age": {"type": "integer", "maximum": 99}},
              "required": ["name", "age"], "additionalProperties": False}
    params = SamplingParams(temperature=0.0, max_tokens=40, json_schema=json.dumps(schema),
                            frequency_penalty=0.5, presence_penalty=0.3,
                            repetition_penalty=1.2, logit_bias={"90": 5.0})
    expected, split = _mixed_and_split(engines, params)
    for rid in expected:
        assert split[rid] == expected[rid]
        text = engines["mixed"].tokenizer.decode(expected[rid], skip_special_tokens=True)
        jsonschema.validate(json.loads(text), schema)


def test_a_migrated_request_continues_where_it_stopped(engines: dict[str, LLMEngine]) -> None:
    """A request that already produced tokens elsewhere (its worker died) is recomputed with
    them as output: the continuation equals the uninterrupted run, penalties and grammar
    included, and max_tokens counts the earlier tokens. (One engine without a prefix
    cache runs all: each resumed run recomputes the prompt and the earlier tokens.)"""
    engine = engines["mixed"]
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}},
              "required": ["name"], "additionalProperties": False}
    for params in (PARAMS,
                   SamplingParams(temperature=0.0, max_tokens=30, json_schema=json.dumps(schema),
                                  frequency_penalty=0.8, presence_penalty=0.4,
                                  repetition_penalty=1.3)):
        prompt = list(range(300, 317))
        engine.add_request("a", prompt, params)
        expected = _run_until_idle(engine)["a"]
        for cut in (1, 5, len(expected) - 1):
            engine.add_request("a", prompt, params, output_token_ids=expected[:cut])
            assert _run_until_idle(engine)["a"] == expected[cut:]
            assert_pool_free(engine)
    with pytest.raises(ValueError, match="already reach max_tokens"):
        engine.add_request("a", prompt, PARAMS, output_token_ids=[1] * 12)
    assert_pool_free(engine)


def test_an_engine_changes_role_only_when_empty_and_keeps_its_prefix_cache():
    """Decode -> prefill -> decode on one engine (what a worker's role change does): with a
    request inside it refuses; as prefill it parks a prompt's KV until released; back as
    decode, the same prompt hits the blocks the prefill role cached and decodes the
    transformers tokens."""
    engine = _engine("decode", 48)
    engine.add_request("busy", list(range(300, 310)), PARAMS)
    with pytest.raises(ValueError, match=r"\(0 running, 1 waiting, 0 parked\)"):
        engine.set_role("prefill")
    _run_until_idle(engine)
    engine.set_role("prefill")
    prompt = list(range(400, 420))
    engine.add_request("p", prompt, PARAMS)
    _run_until_idle(engine)
    assert list(engine.scheduler.parked) == ["p"]  # kept until shipped
    with pytest.raises(ValueError, match="1 parked"):
        engine.set_role("decode")
    engine.release("p")
    engine.set_role("decode")
    engine.add_request("d", prompt, PARAMS)
    tokens = {"d": engine.step()[0].new_token_ids}
    assert engine.requests["d"].num_cached_tokens == 16  # four full blocks of the prompt
    for rid, new in _run_until_idle(engine).items():
        tokens[rid].extend(new)
    assert tokens["d"] == hf_greedy("tiny", prompt, PARAMS.max_tokens)
    assert_pool_free(engine)


def test_a_seeded_sample_split_over_two_roles_draws_as_on_one(
        engines: dict[str, LLMEngine]) -> None:
    """The decode side's generator continues past the draw the prefill side spent on the
    first token (`engine.sampler.skip_draws`): the same tokens as one mixed engine."""
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    expected, split = _mixed_and_split(engines, params)
    assert split == expected


def test_a_migrated_seeded_sample_continues_its_draws(engines: dict[str, LLMEngine]) -> None:
    """A seeded sample resumed elsewhere with the tokens it already streamed continues its
    random stream past their draws (`engine.sampler.skip_draws`): the same continuation as
    the undisturbed run on this model."""
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    prompt = list(range(800, 815))
    engine = engines["mixed"]
    engine.add_request("r", prompt, params)
    expected = _run_until_idle(engine)["r"]
    engine.add_request("r", prompt, params, output_token_ids=expected[:5])
    assert _run_until_idle(engine)["r"] == expected[5:]
    assert_pool_free(engine)
