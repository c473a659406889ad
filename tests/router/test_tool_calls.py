"""Tool calling through the official `openai` client against a real server on the tiny model:
forced calls (`required`, a named function) whose arguments the grammar keeps valid, streamed
as OpenAI streams them, `none`, and a history of calls and results rendered into the prompt.
What a real model does with tools (SmolLM2) is in `test_tool_calls_smollm2.py`."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from cluster.engine_backend import EngineBackend
from engine import CacheConfig, LLMEngine, SamplingParams
from router import openai_protocol
from router.servers import start_servers
from tests.conftest import assert_pool_free

TRIP = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
        "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 9}}}
ALARM = {"type": "object", "additionalProperties": False, "required": ["hour"],
         "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}}}
TOOLS = [{"type": "function", "function": {"name": "plan_trip", "description": "Plan a trip.",
                                           "parameters": TRIP}},
         {"type": "function", "function": {"name": "set_alarm", "parameters": ALARM}}]
SCHEMAS = {"plan_trip": TRIP, "set_alarm": ALARM}
MESSAGES = [{"role": "user", "content": "Plan me a short trip to Rome."}]
NAMED = {"type": "function", "function": {"name": "plan_trip"}}


@pytest.fixture
def api(servers) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{servers.http_port}/v1",
                         api_key="unused", max_retries=0, timeout=60)


def _create(api: openai.OpenAI, **fields):
    fields = {"messages": MESSAGES, "tools": TOOLS, "temperature": 0.0, "max_tokens": 60,
              **fields}
    return api.chat.completions.create(model="tiny", **fields)


def _streamed_calls(chunks) -> tuple[list[dict], str, list]:
    """The tool calls a streaming client assembles from the deltas (as the OpenAI SDK's
    helpers do: by `index`, `arguments` concatenated), the finish reason, and the deltas."""
    calls: dict[int, dict] = {}
    deltas, finish = [], None
    for chunk in chunks:
        choice = chunk.choices[0]
        deltas.append(choice.delta)
        finish = choice.finish_reason or finish
        for call in choice.delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": call.id, "name": call.function.name,
                                                  "arguments": ""})
            assert call.id is None or call.id == entry["id"]
            entry["arguments"] += call.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish, deltas


def _check(call, name: str | None = None) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert name is None or call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_named_function_is_called_with_valid_arguments(api):
    resp = _create(api, tool_choice=NAMED)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    _check(choice.message.tool_calls[0], "plan_trip")


def test_a_named_call_streams_its_arguments(api):
    whole = _create(api, tool_choice=NAMED).choices[0].message.tool_calls[0]
    calls, finish, deltas = _streamed_calls(_create(api, tool_choice=NAMED, stream=True))
    assert finish == "tool_calls" and len(calls) == 1
    assert calls[0]["name"] == "plan_trip" and calls[0]["id"].startswith("call_")
    assert calls[0]["arguments"] == whole.function.arguments  # greedy: the same call
    assert deltas[0].role == "assistant" and deltas[0].content is None
    assert sum(1 for d in deltas if d.tool_calls) > 2  # the arguments came in pieces


def test_required_calls_one_of_the_tools(api):
    # One call: the random model would go on adding calls to the array (parallel calls are
    # checked on SmolLM2).
    extra = {"parallel_tool_calls": False}
    resp = _create(api, tool_choice="required", **extra)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    _check(choice.message.tool_calls[0])
    calls, finish, _ = _streamed_calls(_create(api, tool_choice="required", stream=True,
                                               **extra))
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_a_call_cut_off_by_max_tokens_is_text_with_finish_reason_length(api):
    choice = _create(api, tool_choice="required", max_tokens=3).choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content == '[{"name'


def test_none_answers_in_text_with_the_tools_in_the_prompt(api, servers, offline):
    resp = _create(api, tool_choice="none", max_tokens=5, extra_body={"ignore_eos": True})
    choice = resp.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "length"
    tokenized = httpx.post(f"http://127.0.0.1:{servers.http_port}/tokenize",
                           json={"messages": MESSAGES, "tools": TOOLS}).json()
    assert resp.usage.prompt_tokens == tokenized["count"]
    ref = offline.generate(tokenized["tokens"], SamplingParams(max_tokens=5, temperature=0,
                                                               ignore_eos=True))
    assert choice.message.content == ref[0].outputs[0].text


def test_calls_and_results_in_the_history_render_in_the_documented_plain_form(api, servers,
                                                                              offline):
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {
                       "name": "plan_trip", "arguments": '{"city": "Rome", "days": 3}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"booked": true}'}]
    tokenized = httpx.post(f"http://127.0.0.1:{servers.http_port}/tokenize",
                           json={"messages": history, "tools": TOOLS[:1]}).json()
    function = json.dumps({"name": "plan_trip", "description": "Plan a trip.",
                           "parameters": TRIP})
    assert offline.tokenizer.decode(tokenized["tokens"]) == (
        "<|im_start|>system\nYou can call these functions:\n" + function + "<|im_end|>\n"
        "<|im_start|>user\nPlan me a short trip to Rome.<|im_end|>\n"
        '<|im_start|>assistant\n{"name": "plan_trip", "arguments": {"city": "Rome", '
        '"days": 3}}<|im_end|>\n'
        '<|im_start|>tool\n{"booked": true}<|im_end|>\n'
        "<|im_start|>assistant\n")
    resp = api.chat.completions.create(model="tiny", messages=history, tools=TOOLS[:1],
                                       tool_choice="none", max_tokens=4, temperature=0.0)
    assert resp.usage.prompt_tokens == tokenized["count"]


def test_an_agent_replays_its_conversation_with_every_field_the_sdk_emits(api, caplog,
                                                                         monkeypatch):
    """Turns as an agent framework on the OpenAI SDK sends them: each assistant answer
    appended as the SDK returns it (`model_dump()`: `refusal`, `annotations`, `audio` and
    `function_call` null beside the calls), a tool result after each call, and request
    fields OpenAI defines that change nothing here (`store`, `metadata`, `service_tier`,
    `parallel_tool_calls`, `user`). Every turn is served, and the replayed history is the
    same prompt as the history without those fields; each ignored field is logged once."""
    extra = {"store": False, "metadata": {"run": "agent-7"}, "service_tier": "auto",
             "parallel_tool_calls": False, "user": "agent-7"}
    history: list[dict] = list(MESSAGES)
    monkeypatch.setattr(openai_protocol, "_ignored_seen", set())  # none logged yet
    with caplog.at_level(logging.INFO, logger="router.openai_protocol"):
        for name in ("plan_trip", "set_alarm"):
            named = {"type": "function", "function": {"name": name}}
            message = _create(api, messages=history, tool_choice=named, **extra).choices[0].message
            _check(message.tool_calls[0], name)
            replayed = message.model_dump()
            assert {"refusal", "annotations", "audio", "function_call"} <= set(replayed)
            history += [replayed, {"role": "tool", "tool_call_id": message.tool_calls[0].id,
                                   "content": '{"ok": true}'}]
        final = _create(api, messages=history, tool_choice="none", max_tokens=4, **extra)
    assert final.choices[0].finish_reason in ("length", "stop")
    plain = [{k: v for k, v in m.items() if k in ("role", "content", "tool_calls",
                                                  "tool_call_id") and v is not None}
             for m in history]
    again = _create(api, messages=plain, tool_choice="none", max_tokens=4)
    assert again.usage.prompt_tokens == final.usage.prompt_tokens
    assert again.choices[0].message.content == final.choices[0].message.content
    ignored = [r.args[0] for r in caplog.records if "ignoring request field" in r.msg]
    assert sorted(ignored) == sorted({"store", "metadata", "service_tier", "refusal",
                                      "annotations", "audio", "function_call"})  # once each


def test_parameters_the_grammar_cannot_hold_are_a_400(api):
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "frobnicate"}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        _create(api, tools=[tool], tool_choice="required")
    assert e.value.body["param"] == "tools"
    assert e.value.body["message"].startswith(
        "tools: a function's parameters cannot be enforced as a grammar (json_schema: ")


# The Hermes tool-call format, as Qwen2.5's template writes it (shortened).
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call functions.\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    'Return each call as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n'
    "{%- endif %}{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{%- endfor %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


@pytest.fixture(scope="module")
def hermes_servers(loop_thread, tiny_dir, tmp_path_factory):
    """The tiny model's weights and tokenizer behind a template with the Hermes format."""
    copy = tmp_path_factory.mktemp("tiny-hermes")
    for path in Path(tiny_dir).iterdir():
        if path.name != "chat_template.jinja":
            (copy / path.name).symlink_to(path)
    (copy / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    backend = EngineBackend(LLMEngine(str(copy), cache=CacheConfig(num_blocks=64)), "tiny")
    servers = loop_thread.run(start_servers(backend))
    yield servers
    loop_thread.run(servers.stop(grace=0.5))
    backend.loop.call(assert_pool_free)
    backend.close()


@pytest.mark.server
def test_auto_on_a_hermes_template_answers_in_text_when_the_model_calls_nothing(
        hermes_servers):
    # The random model never writes a <tool_call> block (the parsing of one is tested
    # without a server): auto must leave its text alone, unconstrained.
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{hermes_servers.http_port}/v1",
                        api_key="unused", max_retries=0, timeout=60)
    fields = {"max_tokens": 6, "extra_body": {"ignore_eos": True}}
    choice = _create(api, **fields).choices[0]  # tool_choice defaults to auto with tools
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert "<tool_call>" not in choice.message.content
    chunks = list(_create(api, stream=True, tool_choice="auto", **fields))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    tokenized = httpx.post(f"http://127.0.0.1:{hermes_servers.http_port}/tokenize",
                           json={"messages": MESSAGES, "tools": TOOLS}).json()
    prompt = hermes_servers.router.tokenizer.decode(tokenized["tokens"])
    assert prompt.startswith("<|im_start|>system\nYou may call functions.\n<tools>"
                             '{"type": "function", "function": {"name": "plan_trip"')
