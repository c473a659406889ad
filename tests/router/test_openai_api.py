"""The OpenAI fields beyond plain sampling, through the official `openai` client against a real
router over a real tiny engine: penalties and logit_bias against a reference computation on
`transformers` logits, n > 1, several prompts, echo, null assistant content, unknown fields.
"""

from __future__ import annotations

from collections import Counter

import httpx
import openai
import pytest
import torch

from tests.conftest import hf_model

PROMPT_IDS = [1200, 3400, 560, 78, 9000, 4321, 222]
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture
def api(servers) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{servers.http_port}/v1", api_key="unused",
                         max_retries=0, timeout=60)


def _reference_greedy(prompt: list[int], served: list[int], presence: float = 0.0,
                      frequency: float = 0.0, repetition: float = 1.0,
                      bias: dict[int, float] | None = None) -> list[int]:
    """What greedy decoding picks at each step, given the served tokens before it: the
    `transformers` logits with OpenAI's presence/frequency penalties, the CTRL repetition
    penalty and logit_bias applied as each is defined."""
    model = hf_model("tiny")
    picks = []
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + served])).logits[0].double()
    for t in range(len(served)):
        row = logits[len(prompt) + t - 1].clone()
        for token_id, value in (bias or {}).items():
            row[token_id] += value
        for token_id in set(prompt + served[:t]):
            if repetition != 1.0:
                row[token_id] = (row[token_id] / repetition if row[token_id] > 0
                                 else row[token_id] * repetition)
        for token_id, count in Counter(served[:t]).items():
            row[token_id] -= frequency * count + presence
        picks.append(int(row.argmax()))
    return picks


def _served_ids(api: openai.OpenAI, max_tokens: int = 16, **fields) -> list[int]:
    """The served greedy tokens as ids (vLLM's `return_tokens_as_token_ids` names each
    logprobs token `token_id:N`)."""
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True,
             **fields.pop("extra_body", {})}
    resp = api.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=max_tokens,
                                  logprobs=0, temperature=0.0, extra_body=extra, **fields)
    tokens = resp.choices[0].logprobs.tokens
    assert len(tokens) == resp.usage.completion_tokens == max_tokens
    return [int(token.removeprefix("token_id:")) for token in tokens]


@pytest.mark.parametrize("fields", [
    {"frequency_penalty": 1.5},
    {"presence_penalty": 2.0},
    {"extra_body": {"repetition_penalty": 3.0}},
    {"frequency_penalty": 0.7, "presence_penalty": -0.4,
     "extra_body": {"repetition_penalty": 1.3}},
])
def test_penalties_change_tokens_as_defined(api, fields):
    # The tiny random model never repeats a token on its own: a bias on its first greedy
    # token makes it come back, so the penalties have repeats to act on.
    bias = {_served_ids(api)[0]: 2.0}
    biased = _served_ids(api, logit_bias=_json_bias(bias))
    served = _served_ids(api, logit_bias=_json_bias(bias), **fields)
    kwargs = {"frequency": fields.get("frequency_penalty", 0.0),
              "presence": fields.get("presence_penalty", 0.0),
              "repetition": fields.get("extra_body", {}).get("repetition_penalty", 1.0)}
    assert served != biased  # the penalty had something to act on
    assert served == _reference_greedy(PROMPT_IDS, served, bias=bias, **kwargs)


@pytest.mark.parametrize("value", [10.0, -100.0])
def test_logit_bias_changes_tokens_as_defined(api, value):
    plain = _served_ids(api)
    bias = {plain[0]: value}
    served = _served_ids(api, logit_bias=_json_bias(bias))
    assert served != plain
    assert served == _reference_greedy(PROMPT_IDS, served, bias=bias)


def _json_bias(bias: dict[int, float]) -> dict[str, float]:
    return {str(token_id): value for token_id, value in bias.items()}


def test_n_returns_n_choices_and_sums_usage(api):
    resp = api.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=6, n=3,
                                  temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert len({c.text for c in resp.choices}) == 3  # seeds 11, 12, 13: different draws
    assert resp.usage.prompt_tokens == len(PROMPT_IDS)
    assert resp.usage.completion_tokens == 3 * 6
    again = api.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=6, n=3,
                                   temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]


def test_chat_n_streams_every_choice_and_one_usage_chunk(api):
    stream = api.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, n=2,
        stream=True, stream_options={"include_usage": True}, **GREEDY)
    texts = {0: "", 1: ""}
    finishes, usages = {}, []
    for chunk in stream:
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    full = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=5, **GREEDY)
    assert texts == {0: full.choices[0].message.content, 1: full.choices[0].message.content}
    assert finishes == {0: "length", 1: "length"}
    assert len(usages) == 1 and usages[0].completion_tokens == 10
    assert usages[0].prompt_tokens == full.usage.prompt_tokens


def test_several_prompts_in_one_request(api):
    prompts = ["The quick brown fox", "Once upon a time"]
    singles = [api.completions.create(model="tiny", prompt=p, max_tokens=5, **GREEDY)
               for p in prompts]
    resp = api.completions.create(model="tiny", prompt=prompts, max_tokens=5, n=2, **GREEDY)
    assert [c.text for c in resp.choices] == [singles[0].choices[0].text] * 2 + \
        [singles[1].choices[0].text] * 2
    assert resp.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert resp.usage.completion_tokens == 4 * 5


def test_echo_returns_the_prompt_before_the_completion(api):
    plain = api.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=4,
                                   **GREEDY)
    echoed = api.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=4,
                                    echo=True, **GREEDY)
    assert echoed.choices[0].text == "The quick brown fox" + plain.choices[0].text
    chunks = api.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=4,
                                    echo=True, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text


def test_assistant_message_with_null_content(api):
    resp = api.chat.completions.create(
        model="tiny", max_tokens=3, messages=[
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
            {"role": "user", "content": "again"}], **GREEDY)
    assert resp.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model="tiny", max_tokens=3,
                                    messages=[{"role": "user", "content": None}])
    assert e.value.body["param"] == "messages"


@pytest.mark.parametrize(("fields", "param"), [
    ({"suffix": "!"}, "suffix"),
    ({"best_of": 2}, "best_of"),
    ({"extra_body": {"guided_json": {"type": "object"}}}, "guided_json"),
    ({"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "stream_options"),
])
def test_unsupported_fields_are_refused_by_name(api, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model="tiny", prompt="hi", max_tokens=2, **fields)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param
    assert "not supported" in e.value.body["message"]


@pytest.mark.parametrize("choice", [None, "auto"])
def test_auto_tool_choice_without_a_template_format_is_a_400(api, choice):
    # The tiny model has SmolLM2's chat template, which defines no tool-call format; auto is
    # the default when tools are given, as in OpenAI.
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    extra = {} if choice is None else {"tool_choice": choice}
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                    tools=[tool], **extra)
    assert e.value.body["param"] == "tool_choice"
    assert e.value.body["message"].startswith(
        "tool_choice: 'auto' needs the model's own tool-call format; this model's chat "
        "template has no tool-call format.")


def test_chat_without_max_tokens_runs_to_the_end_of_the_context(api, servers):
    resp = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       **GREEDY)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens + resp.usage.completion_tokens == \
        servers.router.model_info.max_model_len


@pytest.mark.parametrize(("path", "body", "param"), [
    ("completions", b'{"prompt": "a \\ud800 b", "max_tokens": 2}', "prompt"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "a \\ud800"}]}',
     "messages"),
])
def test_lone_surrogates_are_a_400_not_a_500(servers, path, body, param):
    resp = httpx.post(f"http://127.0.0.1:{servers.http_port}/v1/{path}", content=body,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == param
    assert "lone surrogate" in resp.json()["error"]["message"]


def test_sse_is_not_cached(servers):
    body = {"prompt": "hi", "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"http://127.0.0.1:{servers.http_port}/v1/completions",
                      json=body, timeout=30) as resp:
        assert resp.headers["cache-control"] == "no-cache"
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
