"""Tool calling on SmolLM2 through the official `openai` client: a forced call's arguments
validate against the function's schema, `required` picks among tools, and the call and the
`tool` result reach the next turn's prompt, which is answered in text."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from router.servers import Servers

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 30},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["timezone"],
        "properties": {"timezone": {"type": "string", "maxLength": 30}}}
TOOLS = [{"type": "function", "function": {
             "name": "get_weather", "description": "The current weather in a city.",
             "parameters": WEATHER}},
         {"type": "function", "function": {
             "name": "get_time", "description": "The current time in a timezone.",
             "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture
def api(smollm2_servers: Servers) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{smollm2_servers.http_port}/v1",
                         api_key="unused", max_retries=0, timeout=120)


def test_a_forced_call_then_its_result_answered(api, smollm2_servers, smollm2):
    resp = api.chat.completions.create(
        model="smollm2", messages=QUESTION, tools=TOOLS, max_tokens=80, temperature=0.0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)

    history = [*QUESTION, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id,
                "content": '{"temperature": 21, "sky": "sunny"}'}]
    answer = api.chat.completions.create(model="smollm2", messages=history, tools=TOOLS,
                                         tool_choice="none", max_tokens=20, temperature=0.0)
    tokenized = httpx.post(f"http://127.0.0.1:{smollm2_servers.http_port}/tokenize",
                           json={"messages": history, "tools": TOOLS}, timeout=60).json()
    assert answer.usage.prompt_tokens == tokenized["count"]
    # The tool's result and the call are in the prompt the answer was generated from.
    prompt = smollm2.tokenizer.decode(tokenized["tokens"])
    assert '{"temperature": 21, "sky": "sunny"}' in prompt
    assert json.dumps({"name": "get_weather",
                       "arguments": json.loads(call.function.arguments)}) in prompt
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content  # an answer in text


def test_required_picks_a_tool_with_valid_arguments(api):
    resp = api.chat.completions.create(model="smollm2", messages=QUESTION, tools=TOOLS,
                                       tool_choice="required", max_tokens=60, temperature=0.0)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
