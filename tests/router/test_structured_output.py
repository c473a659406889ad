"""`response_format` on SmolLM2 through the official `openai` client: every answer of a fixed
set of prompts parses and validates against its schema."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from router.servers import Servers

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 30},
                         "age": {"type": "integer", "minimum": 0, "maximum": 130},
                         "city": {"type": "string", "maxLength": 30}}}
BOOK = {"type": "object", "additionalProperties": False, "required": ["title", "genre", "tags"],
        "properties": {"title": {"type": "string", "maxLength": 40},
                       "genre": {"enum": ["fiction", "history", "science"]},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                "minItems": 1, "maxItems": 3}}}
CASES = [
    ("Describe a famous scientist as JSON.", PERSON),
    ("Invent a person who lives in Paris. Answer in JSON.", PERSON),
    ("What is the capital of France?", PERSON),
    ("Recommend a book as JSON.", BOOK),
    ("Tell me about the history of Rome.", BOOK),
]


@pytest.fixture
def api(smollm2_servers: Servers) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{smollm2_servers.http_port}/v1",
                         api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize(("prompt", "schema"), CASES)
def test_json_schema_output_validates(api, prompt, schema):
    resp = api.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": prompt}], max_tokens=120,
        temperature=0.0, response_format={"type": "json_schema", "json_schema": {
            "name": "answer", "schema": schema, "strict": True}})
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_output_parses_when_sampled(api):
    # top_p 1 (SmolLM2's generation config says 0.9): the draw seed 3 was chosen for.
    resp = api.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Give me a JSON object."}],
        max_tokens=120, temperature=0.8, seed=3, n=2, top_p=1.0,
        response_format={"type": "json_object"})
    for choice in resp.choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(json.loads(choice.message.content), dict)


def test_an_invalid_schema_is_a_400(api):
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "object", "properties": {"a": {"type": 7}}}}})
    assert e.value.body["param"] == "json_schema"
