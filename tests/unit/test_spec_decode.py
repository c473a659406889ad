"""Speculative decoding: the configuration, the n-gram proposer, the scheduler's lookahead
and rollback, greedy output equal to plain decoding and to `transformers` (n-gram, the
self-draft, a separate draft model), and the rejection-sampling rule preserving the target
distribution."""

from __future__ import annotations

import json
import math
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, CacheConfig, LLMEngine, SamplingParams
from engine.block_pool import BlockPool, hash_blocks
from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.model_loader import resolve_model_dir
from engine.request import Request
from engine.scheduler import Scheduler
from engine.spec_decode import (
    MAX_DRAFT_BACKOFF,
    SpeculativeConfig,
    draft_allowed,
    ngram_propose,
    record_verified,
)
from engine.spec_verify import verify
from engine.tokenizer import apply_chat_template
from tests.conftest import SMOL_CHATS, assert_pool_free, hf_greedy, truncated_model
from tests.unit.test_roles import _prefill_then_hand_over, _run_until_idle

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
SELF_DRAFT = {"method": "draft", "model": "self", "draft_layers": 2,
              "num_speculative_tokens": 3}
SMOL_SELF_DRAFT = {**SELF_DRAFT, "draft_layers": 24}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor "
        "jugs. How vexingly quick daft zebras jump. Sphinx of black quartz, judge my vow.")
COPY = [{"role": "user", "content": f"Repeat this text exactly:\n\n{TEXT}"}]


# ---- configuration ----------------------------------------------------------------------

@pytest.mark.parametrize(("config", "message"), [
    ('{"method": "ngram"', "not valid JSON"),
    ('["ngram"]', "must be a JSON object"),
    ({"method": "ngram", "num_speculative_tokens": 4, "num_spec_tokens": 2},
     "unknown key 'num_spec_tokens'"),
    ({"num_speculative_tokens": 4}, "speculative_config.method: required"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens: required"),
    ({"method": "eagle", "num_speculative_tokens": 4}, "method: must be 'ngram' or 'draft'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens: must be an "
                                                       "integer in [1, 32], got 0"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 4, "model": "self"},
     "speculative_config.model: not a key of method 'ngram'"),
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5,
      "prompt_lookup_max": 2}, "prompt_lookup_min (5) must be <= prompt_lookup_max (2)"),
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 0},
     "speculative_config.prompt_lookup_max: must be an integer"),
    ({"method": "draft", "num_speculative_tokens": 4, "model": "self"},
     "speculative_config.draft_layers: required"),
    ({"method": "draft", "num_speculative_tokens": 4},
     "speculative_config.model: required with method 'draft'"),
    ({"method": "draft", "num_speculative_tokens": 4, "model": 3},
     "speculative_config.model: required with method 'draft'"),
    ({"method": "draft", "num_speculative_tokens": 4, "model": "/models/smaller",
      "draft_layers": 2}, "speculative_config.draft_layers: only with model 'self'"),
    ({"method": "draft", "num_speculative_tokens": 4, "model": "self", "draft_layers": 2,
      "prompt_lookup_max": 3}, "speculative_config.prompt_lookup_max: not a key of method"),
])
def test_bad_configs_name_the_key(config, message):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.parse(config)
    assert message in str(e.value)


def test_ngram_bounds_default_like_vllm():
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}') == \
        SpeculativeConfig("ngram", 3, 5, 5)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                    "prompt_lookup_max": 4}).prompt_lookup_min == 4
    assert SpeculativeConfig.parse(None) is None


def test_self_draft_must_stop_below_the_target_depth():
    with pytest.raises(ValueError, match="draft_layers: must be below the target's 3 layers"):
        LLM("tiny", cache=CacheConfig(num_blocks=16),
            speculative_config={**SELF_DRAFT, "draft_layers": 3})


# ---- n-gram proposer -------------------------------------------------------------------

def test_ngram_takes_the_longest_latest_match_and_at_most_k():
    # Suffix [2, 3]: its latest earlier occurrence is at index 5, followed by 9, 9, 2, 3.
    tokens = [1, 2, 3, 4, 5, 2, 3, 9, 9, 2, 3]
    assert ngram_propose(tokens, 3, 1, 2) == [9, 9, 2]
    assert ngram_propose(tokens, 8, 1, 2) == [9, 9, 2, 3]
    # Suffix [5, 7] never occurred, [7] did once (followed by 1).
    assert ngram_propose([7, 1, 5, 7], 2, 1, 2) == [1, 5]
    assert ngram_propose([7, 1, 5, 7], 2, 2, 2) == []
    assert ngram_propose([4], 2, 1, 3) == []


# ---- scheduler: lookahead budget, blocks and rollback ----------------------------------

def _decoding(kv: KVCacheManager, budget: int, lookahead: int, prompt_lens: list[int],
              max_tokens: int = 16) -> tuple[Scheduler, list[Request]]:
    """A scheduler whose requests have their prompts computed and first tokens (7) out,
    drafting up to `lookahead` tokens from then on."""
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=budget), kv)
    requests = [Request(str(i), list(range(1, n + 1)),
                        SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                for i, n in enumerate(prompt_lens)]
    for r in requests:
        s.add_request(r)
    s.postprocess(s.schedule(), {r.request_id: [7] for r in requests})
    s.num_lookahead = lambda r: lookahead
    return s, requests


def test_lookahead_takes_budget_and_slots_only_while_they_are_there():
    kv = KVCacheManager(BlockPool(12, enable_prefix_caching=False), 4)
    s, (a, b, c) = _decoding(kv, 10, 4, [3, 3, 3])  # 4 tokens, 3 computed, 1 block each
    out = s.schedule()
    # Each request keeps a token of the budget of 10 for those behind it: a drafts 4,
    # b 3 (10 - 5 - 1 - 1), c none.
    assert [(i.request.request_id, i.num_new_tokens, i.num_lookahead)
            for i in out.scheduled] == [("0", 1, 4), ("1", 1, 3), ("2", 1, 0)]
    # Slots for positions 3..7 (a) and 3..6 (b): two blocks each.
    assert [len(r.block_ids) for r in (a, b, c)] == [2, 2, 1]
    assert kv.pool.num_free_blocks == 7
    # No drafts came: each request computes its one token and gives the lookahead back.
    s.postprocess(out, {"0": [5], "1": [5], "2": [5]})
    assert [len(r.block_ids) for r in (a, b, c)] == [1, 1, 1]
    assert kv.pool.num_free_blocks == 9
    # 3 free blocks: each request needs one for its next token, none is left for drafts
    # (a lookahead of 4 from position 4 needs a second), and nobody is preempted.
    kv.pool.allocate(6)
    out = s.schedule()
    assert [(i.num_new_tokens, i.num_lookahead) for i in out.scheduled] == [(1, 0)] * 3
    assert not out.preempted and kv.pool.num_free_blocks == 0


def test_rejected_drafts_are_rolled_back_and_never_cached():
    kv = KVCacheManager(BlockPool(16), 4)
    s, (request,) = _decoding(kv, 64, 4, [6])  # tokens 1..6, 7: 7 tokens, 6 computed
    out = s.schedule()
    (item,) = out.scheduled
    assert item.num_lookahead == 4 and len(request.block_ids) == 3  # slots for 6..10
    request.spec_token_ids = [8, 9, 10, 11]
    item.num_new_tokens = 5
    # Verification accepted 8, rejected 9 and sent 20 instead: KV is valid for 7 and 8.
    s.postprocess(out, {"0": [8, 20]})
    assert request.output_token_ids == [7, 8, 20]
    assert request.num_computed_tokens == 8 and request.spec_token_ids == []
    assert len(request.block_ids) == 2  # the block for positions 8..11 went back
    # Only the full blocks of verified tokens are in the prefix cache.
    cached = set(kv.pool.cached)
    assert cached == set(hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4))


def test_a_step_never_emits_past_max_tokens():
    kv = KVCacheManager(BlockPool(16), 4)
    s, (request,) = _decoding(kv, 64, 4, [6], max_tokens=3)
    out = s.schedule()
    (item,) = out.scheduled
    assert item.num_lookahead == 1  # 2 tokens left to emit: one draft and one more
    request.spec_token_ids = [8]
    item.num_new_tokens = 2
    s.postprocess(out, {"0": [8, 9]})
    assert request.output_token_ids == [7, 8, 9] and request.finish_reason == "length"
    assert kv.pool.num_free_blocks == 16


# ---- greedy output: identical to plain decoding and to transformers --------------------

def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        # Half repetitive (the n-gram proposer finds matches), half random.
        base = [rng.randrange(100, 49000) for _ in range(rng.randint(4, 30))]
        prompts.append(base * rng.choice((1, 3)))
    return prompts


@pytest.mark.parametrize("mode", ["ngram", "self-draft", "draft-model"])
def test_tiny_greedy_matches_hf_in_a_mixed_batch(mode, tiny_draft):
    """Speculative and plain requests in one continuous batch (a grammar request and a
    seeded sampled one decode plainly), on a small pool and a small budget that preempt
    and chunk (a draft model catches up again after a preemption): greedy tokens equal
    `transformers`', the others equal a plain engine's."""
    config = {"ngram": NGRAM, "self-draft": SELF_DRAFT,
              "draft-model": model_draft(tiny_draft)}[mode]
    prompts = _prompts(8, seed=11)
    cache = CacheConfig(block_size=4, num_blocks=96)
    sched = SchedulerConfig(max_num_batched_tokens=40)
    others = [SamplingParams(temperature=0.0, max_tokens=12, json_schema='{"type": "object"}'),
              SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)]
    params = [GREEDY] * len(prompts) + others
    llm = LLM("tiny", cache=cache, scheduler=sched, speculative_config=config)
    outputs = llm.generate(prompts + prompts[:2], params)
    for prompt, out in zip(prompts, outputs, strict=False):
        assert out.outputs[0].token_ids == hf_greedy("tiny", prompt, GREEDY.max_tokens)
    stats = llm.engine.stats()
    assert stats.spec_verify_steps > 0 and stats.spec_draft_tokens > 0
    assert_pool_free(llm.engine)
    llm.engine.set_speculative_config(None)
    plain = llm.generate(prompts[:2], others)
    assert [o.outputs[0].token_ids for o in outputs[-2:]] == \
        [o.outputs[0].token_ids for o in plain]
    assert llm.engine.stats().spec_verify_steps == stats.spec_verify_steps


def test_drafts_that_miss_back_off_and_a_hit_resets_the_wait():
    """Steps a request drafts in while every draft misses: 0, 2, 5, 10, 19, then every 17th
    (waits of 1, 2, 4, 8, 16, 16 plain steps); one accepted draft makes the next step draft."""
    r = Request("r", [1, 2, 3], GREEDY)
    drafted_at = []
    for step in range(80):
        if draft_allowed(r):
            drafted_at.append(step)
            record_verified(r, 0)
    assert drafted_at == [0, 2, 5, 10, 19, 36, 53, 70]
    assert r.spec_backoff == MAX_DRAFT_BACKOFF
    while not draft_allowed(r):
        pass
    record_verified(r, 2)
    assert draft_allowed(r) and draft_allowed(r)  # no wait after a hit
    record_verified(r, 0)
    assert not draft_allowed(r) and draft_allowed(r)  # and the next miss waits 1 again


@pytest.fixture
def speculative(smollm2: LLM) -> Iterator[LLM]:
    """The session's SmolLM2, handed back decoding plainly."""
    yield smollm2
    smollm2.engine.set_speculative_config(None)
    assert_pool_free(smollm2.engine)


@pytest.mark.slow
def test_smollm2_ngram_greedy_matches_hf_with_accepted_drafts(speculative):
    speculative.engine.set_speculative_config(NGRAM)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    conversations = [COPY] + [[{"role": "user", "content": c}] for c in SMOL_CHATS]
    outputs = speculative.chat(conversations, params)
    for out in outputs:
        assert out.outputs[0].token_ids == hf_greedy("smollm2", out.prompt_token_ids, 32)
    stats = speculative.engine.stats()
    assert stats.spec_accepted_tokens > 0
    assert stats.spec_tokens_per_step > 1.0


@pytest.mark.slow
def test_smollm2_features_in_one_batch_equal_plain_decoding(speculative):
    """Penalties and logit_bias (processed per verified position), a stop string inside an
    accepted run, max_tokens, logprobs, two copies of one request (n = 2), a grammar and a
    seeded sample: token for token, text for text what plain decoding gives."""
    chat = [[{"role": "user", "content": c}] for c in SMOL_CHATS[:1]]
    tok = speculative.tokenizer
    params = [
        SamplingParams(temperature=0.0, max_tokens=40),
        SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.3,
                       frequency_penalty=0.5, logit_bias={tok.encode(" lazy")[0]: -5.0}),
        SamplingParams(temperature=0.0, max_tokens=40, stop=["liquor"]),
        SamplingParams(temperature=0.0, max_tokens=7, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=40),
        SamplingParams(temperature=0.0, max_tokens=24, json_schema='{"type": "object"}'),
        SamplingParams(temperature=0.7, seed=5, max_tokens=16),
    ]
    conversations = [COPY] * 5 + chat * 2

    def run() -> list:
        return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
                 o.outputs[0].logprobs) for o in speculative.chat(conversations, params)]

    plain = run()
    speculative.engine.set_speculative_config(NGRAM)
    spec = run()
    assert [s[:3] for s in spec] == [p[:3] for p in plain]
    assert spec[2][2] == "stop" and "liquor" not in spec[2][1] and "dozen" in spec[2][1]
    assert len(spec[3][0]) == 7 and spec[3][2] == "length"
    for got, want in zip(spec[3][3], plain[3][3], strict=True):
        assert got.keys() == want.keys()
        assert all(math.isclose(got[t], want[t], abs_tol=1e-4) for t in got)
    stats = speculative.engine.stats()
    assert stats.spec_accepted_tokens > 20


@pytest.mark.slow
def test_smollm2_abort_and_migration_resume(speculative):
    """A speculative request aborted mid-flight frees its blocks; one resumed elsewhere
    from the tokens it had streamed (migration) ends exactly as it would have."""
    engine = speculative.engine
    engine.set_speculative_config(NGRAM)
    prompt = apply_chat_template(speculative.tokenizer, COPY)
    params = SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True)
    (whole,) = speculative.generate([prompt], params)
    engine.add_request("spec-a", prompt, params)
    streamed: list[int] = []
    while len(streamed) < 9:
        for out in engine.step():
            streamed += out.new_token_ids
    assert len(streamed) < 28
    engine.abort_request("spec-a")
    assert_pool_free(engine)
    engine.add_request("spec-b", prompt, params, output_token_ids=streamed)
    resumed: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            resumed += out.new_token_ids
    assert streamed + resumed == whole.outputs[0].token_ids


# ---- temperature > 0: the rule preserves the target distribution ------------------------

# Chi-square critical value, 5 degrees of freedom, p = 0.001.
_CHI2_5_DOF = 20.52


def _request(params: SamplingParams) -> Request:
    return Request("r", [1, 2, 3], params)


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    keep = probs > 0
    assert counts[~keep].sum() == 0  # nothing outside the target's support
    expected = probs[keep] * counts.sum()
    return float(((counts[keep] - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, seed=0),
    SamplingParams(temperature=0.7, top_k=5, seed=1),
    SamplingParams(temperature=1.3, top_p=0.8, frequency_penalty=1.0, seed=2),
], ids=["plain", "top-k", "top-p+penalty"])
def test_rejection_sampling_keeps_the_target_distribution(params):
    """Over 6 000 seeded verifications of a two-token draft on a vocabulary of 6: the first
    emitted token follows the target's processed and filtered distribution, and so does the
    second given the first draft was accepted; the draft is accepted as often as the target
    gives it probability (a chi-square test at p = 0.001 with fixed seeds: no flakes)."""
    from engine.sampler import filtered_probs, process_row

    vocab = 6
    logits = torch.tensor([[1.0, 2.0, 0.5, 1.5, -1.0, 0.0],
                           [0.3, -0.5, 1.0, 2.5, 0.0, 1.2],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    draft = [3, 2]
    request = _request(params)
    targets = []
    for j in range(2):
        row = logits[j].clone()
        request.output_token_ids = draft[:j]
        process_row(row, request)
        targets.append(filtered_probs(row, params))
    request.output_token_ids = []
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    accepted = 0
    for _ in range(6000):
        tokens, _ = verify(logits, request, draft)
        assert len(tokens) in (1, 2, 3)
        first[tokens[0]] += 1
        if tokens[0] == draft[0]:
            accepted += 1
            second[tokens[1]] += 1
    assert _chi_square(first, targets[0]) < _CHI2_5_DOF
    assert _chi_square(second, targets[1]) < _CHI2_5_DOF
    p_accept = float(targets[0][draft[0]])
    assert abs(accepted / 6000 - p_accept) < 4 * math.sqrt(p_accept * (1 - p_accept) / 6000)


def test_a_draft_outside_the_filtered_support_is_always_rejected():
    params = SamplingParams(temperature=1.0, top_k=2, seed=4)
    logits = torch.tensor([[3.0, 2.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    request = _request(params)
    seen = {verify(logits, request, [3])[0][0] for _ in range(200)}
    assert seen == {0, 1}


# ---- a separate draft model ------------------------------------------------------------

def model_draft(path: str | Path) -> dict:
    return {"method": "draft", "model": str(path), "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's first 2 layers (of 3): what `SELF_DRAFT` runs."""
    return truncated_model(resolve_model_dir("tiny"), tmp_path_factory.mktemp("draft") / "tiny",
                           SELF_DRAFT["draft_layers"])


def _figures(engine: LLMEngine) -> tuple[int, int, int]:
    stats = engine.stats()
    return stats.spec_draft_tokens, stats.spec_accepted_tokens, stats.spec_verify_steps


def test_a_truncated_draft_model_drafts_what_the_self_draft_does(tiny_draft):
    """The tiny model's first two layers as a model of their own compute what the
    self-draft with draft_layers 2 computes: the same drafts (the draft model first catches
    up on each prompt in the pass of its first draft, and again from scratch after a
    preemption), so the same acceptance figures, and greedy tokens equal to
    `transformers`'."""
    prompts = _prompts(8, seed=11)
    figures = []
    for config in (SELF_DRAFT, model_draft(tiny_draft)):
        engine = LLMEngine("tiny", cache=CacheConfig(block_size=4, num_blocks=64),
                           scheduler=SchedulerConfig(max_num_batched_tokens=40),
                           speculative_config=config)
        requests = [engine.add_request(str(i), p, GREEDY) for i, p in enumerate(prompts)]
        _run_until_idle(engine)
        assert sum(r.num_preemptions for r in requests) > 0
        for prompt, request in zip(prompts, requests, strict=True):
            assert request.output_token_ids == hf_greedy("tiny", prompt, GREEDY.max_tokens)
        figures.append(_figures(engine))
        assert_pool_free(engine)
    assert figures[0] == figures[1]
    assert figures[0][1] > 0  # some drafts were accepted


# tiny: 3 layers, 2 KV heads of 16; a block of 16 tokens holds K and V.
_TINY_LAYER_BLOCK = {"auto": 2 * 16 * 2 * 16 * 4, "int8": 2 * 16 * 2 * (16 + 4)}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_draft_models_pages_share_the_kv_budget(tiny_draft, kv_cache_dtype):
    """A block costs the target's pages and the draft's (its 2 layers, in the target's KV
    dtype), so one budget holds fewer blocks; the draft's pool has as many, and greedy
    output stays the plain engine's."""
    budget = 2**20
    cache = CacheConfig(kv_cache_memory_gb=budget / 2**30, kv_cache_dtype=kv_cache_dtype)
    plain = LLM("tiny", cache=cache)
    llm = LLM("tiny", cache=cache, speculative_config=model_draft(tiny_draft))
    engine = llm.engine
    layer_block = _TINY_LAYER_BLOCK[kv_cache_dtype]
    assert plain.engine.stats().kv_block_bytes == 3 * layer_block
    assert plain.engine.stats().draft_kv_block_bytes == 0
    stats = engine.stats()
    assert (stats.kv_block_bytes, stats.draft_kv_block_bytes) == \
        (5 * layer_block, 2 * layer_block)
    assert plain.engine.block_pool.num_blocks == budget // (3 * layer_block)
    assert engine.block_pool.num_blocks == budget // (5 * layer_block)
    draft_kv = engine.speculator.draft_runner.kv_cache
    assert draft_kv.num_blocks == engine.block_pool.num_blocks
    assert draft_kv.dtype == engine.kv_cache.dtype
    prompts = _prompts(3, seed=5)
    # (int8 pages round the KV: the reference is the plain engine on the same pages.)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == \
        [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY)]
    assert _figures(engine)[0] > 0
    assert_pool_free(engine)


def test_a_decode_engine_drafts_after_the_prompt_kv_arrived(tiny_draft):
    """Disaggregated: the prompts' KV is copied from a prefill engine into the decode
    engine's pages (a draft model's pages are not shipped; one prompt also starts with
    decode-side prefix-cache hits), so the draft model catches up on each whole prompt
    before its first draft: its drafts, and the acceptance figures, equal those of the
    self-draft reading the transferred KV, and greedy tokens equal `transformers`'."""
    shared = list(range(300, 320))
    prompts = {"a": [*shared, 11, 12, 13, 14, 15], "b": list(range(500, 537))}

    def engine(role: str, config: dict | None = None, prefix_caching: bool = True
               ) -> LLMEngine:
        return LLMEngine("tiny", cache=CacheConfig(block_size=4, num_blocks=64,
                                                   enable_prefix_caching=prefix_caching),
                         scheduler=SchedulerConfig(role=role, max_num_batched_tokens=16),
                         speculative_config=config)

    # One prefill engine for both: without a prefix cache it computes each prompt afresh.
    prefill = engine("prefill", prefix_caching=False)
    figures = []
    for config in (SELF_DRAFT, model_draft(tiny_draft)):
        decode = engine("decode", config)
        decode.add_request("warm", [*shared, 7], GREEDY)
        _run_until_idle(decode)
        before = _figures(decode)
        first = _prefill_then_hand_over(prefill, decode, prompts, GREEDY)
        assert decode.requests["a"].num_cached_tokens == 20
        assert [decode.requests[r].draft_num_computed for r in prompts] == [0, 0]
        # One step: the draft catches up and drafts; after verification it counts the
        # verified tokens (the self-draft, too, as it drafts from the last one).
        tokens = {out.request_id: out.new_token_ids for out in decode.step()}
        assert [decode.requests[r].draft_num_computed for r in prompts] == \
            [decode.requests[r].num_computed_tokens for r in prompts]
        for rid, more in _run_until_idle(decode).items():
            tokens[rid] += more
        for rid, prompt in prompts.items():
            assert [first[rid], *tokens[rid]] == hf_greedy("tiny", prompt, GREEDY.max_tokens)
        figures.append(tuple(a - b for a, b in zip(_figures(decode), before, strict=True)))
        assert_pool_free(prefill)
        assert_pool_free(decode)
    assert figures[0] == figures[1]
    assert figures[0][1] > 0


def _unfit_draft(kind: str, tiny_draft: Path, root: Path) -> Path:
    """A copy of the tiny draft that cannot serve the tiny target."""
    path = root / kind
    if kind == "missing":
        return path
    shutil.copytree(tiny_draft, path)
    if kind == "vocab_size":  # one token fewer (the embedding too)
        config = json.loads((path / "config.json").read_text())
        config["vocab_size"] -= 1
        (path / "config.json").write_text(json.dumps(config))
        state = load_file(path / "model.safetensors")
        state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"][:-1].clone()
        save_file(state, path / "model.safetensors")
    elif kind == "tokenizer":  # as many tokens, two of them with each other's ids
        data = json.loads((path / "tokenizer.json").read_text())
        vocab = data["model"]["vocab"]
        vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]
        (path / "tokenizer.json").write_text(json.dumps(data))
    elif kind == "no_weights":
        (path / "model.safetensors").unlink()
    return path


@pytest.fixture(scope="module")
def ngram_engine() -> LLMEngine:
    """An engine decoding with n-grams, on a small pool (the refusals below use none)."""
    return LLMEngine("tiny", cache=CacheConfig(num_blocks=16), speculative_config=NGRAM)


@pytest.mark.parametrize(("kind", "message"), [
    ("missing", "cannot load the draft model .*missing.* is not 'smollm2', 'tiny', a .gguf"),
    ("no_weights", "cannot load the draft model .*no_weights.* has no \\*.safetensors"),
    ("vocab_size", "the draft model .* has a vocabulary of 49151 tokens, the target 49152: "
                   "a draft must share the target's tokenizer"),
    ("tokenizer", "the draft model .* has a tokenizer whose vocabulary differs from the "
                  "target's"),
], ids=["missing", "no_weights", "vocab_size", "tokenizer"])
def test_a_draft_model_that_cannot_serve_the_target_is_refused(tiny_draft, ngram_engine,
                                                              tmp_path, kind, message):
    """At start-up, and when set on a running engine (which then keeps its setting)."""
    config = model_draft(_unfit_draft(kind, tiny_draft, tmp_path))
    with pytest.raises(ValueError, match=f"^speculative_config.model: {message}"):
        LLMEngine("tiny", cache=CacheConfig(num_blocks=16), speculative_config=config)
    with pytest.raises(ValueError, match=f"^speculative_config.model: {message}"):
        ngram_engine.set_speculative_config(config)
    assert ngram_engine.speculative_config.method == "ngram"


@pytest.mark.slow
def test_smollm2_draft_model_drafts_what_the_self_draft_does(speculative, tmp_path):
    """SmolLM2's first 24 layers saved as a model of their own: greedy tokens equal
    `transformers`', and the drafts equal the self-draft's with draft_layers 24, so the
    acceptance figures do too (fp32; the same kernels on the same rows of weights). One
    chat (its drafts are accepted about one time in five) keeps this test short."""
    draft = truncated_model(resolve_model_dir("smollm2"), tmp_path / "smollm2-24",
                            SMOL_SELF_DRAFT["draft_layers"])
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    conversations = [[{"role": "user", "content": SMOL_CHATS[0]}]]
    figures = []
    for config in (SMOL_SELF_DRAFT, model_draft(draft)):
        speculative.engine.set_speculative_config(config)
        before = _figures(speculative.engine)
        for out in speculative.chat(conversations, params):
            assert out.outputs[0].token_ids == hf_greedy("smollm2", out.prompt_token_ids, 32)
        figures.append(tuple(a - b for a, b in zip(_figures(speculative.engine), before,
                                                   strict=True)))
    assert figures[0] == figures[1]
    drafted, accepted, verify_steps = figures[0]
    assert accepted > 0
    assert drafted > 0 and verify_steps > 0
