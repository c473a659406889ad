"""Bad input gets a ValueError naming the field and the limit; the pool stays fully free."""

import json

import pytest

from engine import LLM, CacheConfig, SamplingParams
from engine.model_loader import ModelLoadError
from tests.conftest import assert_pool_free


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", cache=CacheConfig(block_size=16, num_blocks=64))


@pytest.mark.parametrize("prompt,needle", [
    ("", r"prompts\[0\]: must not be empty"),
    ([], "prompt: must not be empty"),
    ([5] * 1024, r"prompt: 1024 tokens is too long; the limit is 1023"),
    ([5, 49152], r"token id 49152 is outside the vocabulary \[0, 49152\)"),
    ([5, -1], "token id -1 is outside the vocabulary"),
    ([5, "x"], "every token id must be an integer"),
    (3.5, r"prompts\[0\]: must be a string or a list of token ids"),
])
def test_bad_prompts(llm, prompt, needle):
    with pytest.raises(ValueError, match=needle):
        llm.generate([prompt, [1, 2, 3]], SamplingParams(max_tokens=4))
    assert_pool_free(llm.engine)


def test_a_bad_prompt_starts_nothing(llm):
    with pytest.raises(ValueError, match="prompts"):
        llm.generate([[7, 8, 9], ""], SamplingParams(max_tokens=4))
    assert_pool_free(llm.engine)
    assert llm.engine.requests == {}


def test_wrong_number_of_sampling_params(llm):
    with pytest.raises(ValueError, match="sampling_params: 2 given for 1 prompts"):
        llm.generate([[1, 2]], [SamplingParams(), SamplingParams()])


def test_max_model_len_caps_output(llm):
    out = llm.generate([[5] * 1020], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"
    assert_pool_free(llm.engine)


def test_unknown_model_path():
    with pytest.raises(ModelLoadError, match="model: '/nonexistent/model' is not"):
        LLM("/nonexistent/model")


def test_corrupt_weights(tmp_path, tiny_dir):
    from pathlib import Path

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((Path(tiny_dir) / name).read_bytes())
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(ValueError, match=r"model\.safetensors is corrupt or unreadable"):
        LLM(str(tmp_path))


def test_weights_of_the_wrong_shape(tmp_path, tiny_dir):
    from pathlib import Path

    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((Path(tiny_dir) / name).read_bytes())
    config = json.loads((Path(tiny_dir) / "config.json").read_text())
    config["hidden_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="shape"):
        LLM(str(tmp_path))


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype: 'float8' is not supported"):
        LLM("tiny", dtype="float8")
