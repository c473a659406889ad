"""A model folder's config.json and tokenizer read without transformers' Auto classes where
the files say everything, and through them where they do not: the same record either way,
scaled rotary embeddings still exact against `transformers`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

import engine.model_loader as model_loader
from engine import LLM, CacheConfig, SamplingParams, apply_chat_template
from engine.model_loader import read_model_config, resolve_model_dir
from engine.tokenizer import load_tokenizer
from tests.conftest import SMOL_CHATS


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_config_json_read_as_is_gives_transformers_record(model: str, monkeypatch) -> None:
    folder = resolve_model_dir(model)
    cfg, hf = read_model_config(folder)
    assert not isinstance(hf, PretrainedConfig)  # read as JSON
    monkeypatch.setattr(model_loader, "_hf_config", AutoConfig.from_pretrained)
    assert read_model_config(folder)[0] == cfg


def _edited_copy(tmp_path: Path, **changes: object) -> Path:
    """tiny's folder with config.json keys changed (None removes the key)."""
    folder = tmp_path / "model"
    shutil.copytree(resolve_model_dir("tiny"), folder)
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        config.pop(key) if value is None else config.__setitem__(key, value)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_key_the_file_leaves_out_takes_the_architectures_default(tmp_path: Path) -> None:
    cfg, hf = read_model_config(_edited_copy(tmp_path, rms_norm_eps=None))
    assert isinstance(hf, PretrainedConfig)
    assert cfg.rms_norm_eps == 1e-6  # LlamaConfig's default


def test_scaled_rotary_embeddings_match_transformers(tmp_path: Path) -> None:
    """Llama 3's frequency scaling, past the original context: built by transformers' own
    rope functions, so greedy tokens equal `transformers`' over a 300-token prompt."""
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128}
    folder = _edited_copy(tmp_path, rope_parameters=rope)
    assert isinstance(read_model_config(folder)[1], PretrainedConfig)
    prompt = list(range(100, 400))
    got = LLM(str(folder), cache=CacheConfig(num_blocks=64)).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                  eos_token_id=None, min_new_tokens=12)[0, len(prompt):]
    assert got[0].outputs[0].token_ids == expected.tolist()


def test_a_generic_tokenizer_is_the_one_autotokenizer_builds() -> None:
    folder = resolve_model_dir("smollm2")
    ours, auto = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert type(ours) is type(auto)
    texts = [*SMOL_CHATS, " spaces  and\ttabs ", "<|im_start|>user\nhé 😀<|im_end|>"]
    assert [ours.encode(t) for t in texts] == [auto.encode(t) for t in texts]
    messages = [{"role": "user", "content": SMOL_CHATS[0]}]
    assert apply_chat_template(ours, messages) == apply_chat_template(auto, messages)
    assert (ours.eos_token_id, ours.bos_token_id, ours.all_special_ids) == (
        auto.eos_token_id, auto.bos_token_id, auto.all_special_ids)
