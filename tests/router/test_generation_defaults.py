"""Sampling defaults from a generation config on every front door (OpenAI completions and
chat, gRPC Generate) of a real router over the tiny engine: a field the request omits takes
the default, one it gives wins, and `status` shows what is in force."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from engine import SamplingParams
from router.client import PdClusterClient

PROMPT_IDS = [1200, 3400, 560, 78, 9000, 4321, 222]
# Seeded requests show the sampling defaults in their tokens (the same seed draws other
# tokens greedily, or with another top_k), and max_new_tokens in their length.
FILE = {"temperature": 1.5, "top_k": 7, "top_p": 0.8, "min_p": 0.05,
        "repetition_penalty": 1.3, "max_new_tokens": 3, "bos_token_id": 1}
DEFAULTS = {"temperature": 1.5, "top_k": 7, "top_p": 0.9, "min_p": 0.05,
            "repetition_penalty": 1.3, "max_tokens": 3}  # with the override's top_p
SEED = 7


@pytest.fixture
def served(make_servers, tmp_path: Path):
    (tmp_path / "generation_config.json").write_text(json.dumps(FILE))
    return make_servers(generation_config=str(tmp_path),
                        override_generation_config={"top_p": 0.9})


@pytest.fixture
def api(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{served.http_port}/v1", api_key="unused",
                         max_retries=0, timeout=60)


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in DEFAULTS}


def _reference(offline, **fields) -> list[int]:
    params = SamplingParams(**{**DEFAULTS, "seed": SEED, "ignore_eos": True, **fields})
    return offline.generate(PROMPT_IDS, params)[0].outputs[0].token_ids


def test_an_omitted_field_takes_the_default_and_a_given_one_wins(served) -> None:
    router = served.router
    omitted = router.prepare(prompt_token_ids=PROMPT_IDS, params={"temperature": None})
    assert _fields(omitted.params) == DEFAULTS
    given = {"temperature": 0.7, "top_k": -1, "top_p": 1.0, "min_p": 0.0,
             "repetition_penalty": 1.0, "max_tokens": 5}
    assert _fields(router.prepare(prompt_token_ids=PROMPT_IDS, params=given).params) == given
    # A default max_tokens is a most: cut to what fits after a long prompt, as vLLM does.
    long_prompt = [PROMPT_IDS[0]] * (router.model_info.max_model_len - 2)
    assert router.prepare(prompt_token_ids=long_prompt).params.max_tokens == 2


def test_openai_completions_and_chat_take_the_defaults(api, offline) -> None:
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    omitted = api.completions.create(model="tiny", prompt=PROMPT_IDS, logprobs=0, seed=SEED,
                                     extra_body=extra)
    ids = [int(t.removeprefix("token_id:")) for t in omitted.choices[0].logprobs.tokens]
    assert ids == _reference(offline)
    assert omitted.usage.completion_tokens == 3
    given = api.completions.create(model="tiny", prompt=PROMPT_IDS, logprobs=0, seed=SEED,
                                   max_tokens=5, extra_body={**extra, "top_k": -1})
    ids = [int(t.removeprefix("token_id:")) for t in given.choices[0].logprobs.tokens]
    assert ids == _reference(offline, max_tokens=5, top_k=-1)
    assert ids[:3] != _reference(offline)

    messages = [{"role": "user", "content": "Hello there"}]
    chat = api.chat.completions.create(model="tiny", messages=messages,
                                       extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 3
    chat = api.chat.completions.create(model="tiny", messages=messages,
                                       max_completion_tokens=4, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 4


def test_grpc_generate_takes_the_defaults(served, offline) -> None:
    with PdClusterClient(f"127.0.0.1:{served.grpc_port}", timeout=30) as client:
        omitted = list(client.generate(prompt_token_ids=PROMPT_IDS, ignore_eos=True,
                                       seed=SEED))
        given = list(client.generate(prompt_token_ids=PROMPT_IDS, ignore_eos=True,
                                     seed=SEED, max_tokens=5, temperature=0.0))
    assert [t for out in omitted for t in out.token_ids] == _reference(offline)
    greedy = [t for out in given for t in out.token_ids]
    assert greedy == _reference(offline, max_tokens=5, temperature=0.0)
    assert greedy[:3] != _reference(offline)


def test_status_shows_the_defaults_and_their_source(served, tmp_path: Path) -> None:
    expected = {"source": str(tmp_path), "file": str(tmp_path / "generation_config.json"),
                "defaults": DEFAULTS, "override": {"top_p": 0.9}}
    with PdClusterClient(f"127.0.0.1:{served.grpc_port}", timeout=30) as client:
        assert client.status()["generation_config"] == expected


def test_without_a_generation_config_the_defaults_are_as_before(servers) -> None:
    """The tiny model's folder has no generation_config.json: SamplingParams' defaults
    (completions: 16 tokens), and chat's max_tokens runs to the end of the context."""
    with PdClusterClient(f"127.0.0.1:{servers.grpc_port}", timeout=30) as client:
        assert client.status()["generation_config"] == \
            {"source": "auto", "file": None, "defaults": {}, "override": {}}
    router = servers.router
    assert router.prepare(prompt_token_ids=PROMPT_IDS).params == SamplingParams()
    chat = router.prepare(prompt_token_ids=PROMPT_IDS,
                          default_max_tokens=router.model_info.max_model_len)
    assert chat.params.max_tokens == router.model_info.max_model_len - len(PROMPT_IDS)
