"""JSON Schema output on the tiny engine: the text validates, a finished grammar allows only
EOS, and a grammar request never disturbs the other requests of its batch."""

import json

import jsonschema

from engine import LLM, CacheConfig, SamplingParams
from tests.conftest import assert_pool_free, hf_greedy

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 9}},
          "required": ["a"], "additionalProperties": False}


def test_finished_grammar_allows_only_eos_even_when_eos_is_ignored():
    llm = LLM("tiny", cache=CacheConfig(num_blocks=64))
    eos = llm.engine.model_config.eos_token_ids
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([[300, 301, 302], [400, 401]], [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                       json_schema=json.dumps(SCHEMA)), plain])
    constrained, neighbour = (o.outputs[0] for o in outs)
    jsonschema.validate(json.loads(constrained.text), SCHEMA)
    assert constrained.finish_reason == "length" and len(constrained.token_ids) == 30
    end = constrained.token_ids.index(eos[0])
    assert all(t in eos for t in constrained.token_ids[end:])
    # The unconstrained request in the same batch is exactly what it is alone.
    assert neighbour.token_ids == hf_greedy("tiny", [400, 401], 12)
    assert_pool_free(llm.engine)
