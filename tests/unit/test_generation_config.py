"""Sampling defaults from `generation_config.json` (`engine.generation_config`): what `auto`,
`vllm`, a folder and an override give, the exact refusals, the flags' way from the command
line, the environment and the config file to the router, the offline `LLM`, and the bundled
SmolLM2's converted folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from commands.cli import main
from engine import (
    LLM,
    CacheConfig,
    GenerationDefaults,
    SamplingParams,
    load_generation_defaults,
    parse_generation_override,
)
from engine.model_loader import resolve_model_dir
from router.router import RouterConfig

KEYS_MESSAGE = "the keys are max_new_tokens, min_p, repetition_penalty, temperature, top_k, top_p"


def write_config(folder: Path, values: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "generation_config.json"
    path.write_text(json.dumps(values))
    return path


# ---- the reader --------------------------------------------------------------------------


def test_auto_reads_the_sampling_keys_of_the_model_folder(tmp_path: Path) -> None:
    path = write_config(tmp_path, {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
        "repetition_penalty": 1.1, "max_new_tokens": 64, "do_sample": False,
        "bos_token_id": 1, "eos_token_id": [2, 3], "typical_p": 0.5})
    found = load_generation_defaults("auto", tmp_path)
    assert found.defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
                              "repetition_penalty": 1.1, "max_tokens": 64}
    assert found.status() == {"source": "auto", "file": str(path),
                              "defaults": dict(found.defaults), "override": {}}
    assert found.sampling_params() == SamplingParams(
        temperature=0.6, top_p=0.95, top_k=20, min_p=0.05, repetition_penalty=1.1,
        max_tokens=64)


def test_auto_without_the_file_and_vllm_give_no_defaults(tmp_path: Path) -> None:
    assert load_generation_defaults("auto", tmp_path) == GenerationDefaults("auto")
    write_config(tmp_path, {"temperature": 0.6})
    assert load_generation_defaults("vllm", tmp_path) == GenerationDefaults("vllm")
    assert load_generation_defaults("vllm", tmp_path).sampling_params() == SamplingParams()


def test_a_folder_is_read_instead_of_the_models(tmp_path: Path) -> None:
    write_config(tmp_path / "model", {"temperature": 0.6, "top_k": 20})
    path = write_config(tmp_path / "mine", {"temperature": 0.3, "top_p": None})
    found = load_generation_defaults(str(tmp_path / "mine"), tmp_path / "model")
    assert (found.source, found.file, found.defaults) == \
        (str(tmp_path / "mine"), str(path), {"temperature": 0.3})


def test_the_override_adds_replaces_and_removes_keys(tmp_path: Path) -> None:
    write_config(tmp_path, {"temperature": 0.6, "top_p": 0.95})
    override = {"temperature": 0.5, "top_p": None, "max_new_tokens": 8}
    found = load_generation_defaults("auto", tmp_path, override)
    assert found.defaults == {"temperature": 0.5, "max_tokens": 8}
    assert found.status()["override"] == override
    # As vLLM: with `vllm` the override alone.
    assert load_generation_defaults("vllm", tmp_path, {"top_k": 5}).defaults == {"top_k": 5}


def test_apply_fills_only_the_fields_a_request_omits() -> None:
    found = GenerationDefaults("auto", None, {"temperature": 0.2, "top_p": 0.9, "max_tokens": 8})
    request = {"temperature": 0.0, "top_p": None, "seed": 3}
    assert found.apply(request) == {"temperature": 0.0, "top_p": 0.9, "seed": 3, "max_tokens": 8}
    assert request == {"temperature": 0.0, "top_p": None, "seed": 3}  # not changed


def test_an_override_is_parsed_from_json() -> None:
    assert parse_generation_override('{"temperature": 0.5, "max_new_tokens": 100}') == \
        {"temperature": 0.5, "max_new_tokens": 100}
    assert parse_generation_override(None) == parse_generation_override("") == {}


@pytest.mark.parametrize(("text", "message"), [
    ('{"temperature": 0.5', "not valid JSON (Expecting ',' delimiter: line 1 column 20 "
                            "(char 19))"),
    ("[1]", "expected a JSON object such as '{\"temperature\": 0.5}', got list"),
    ('{"max_tokens": 5}', f"unknown key 'max_tokens'; {KEYS_MESSAGE}"),
    ('{"temperature": -1}', "temperature must be a finite number >= 0, got -1"),
    ('{"temperature": true}', "temperature must be a finite number >= 0, got True"),
    ('{"top_p": 1.5}', "top_p must be in (0, 1], got 1.5"),
    ('{"top_k": 2.5}', "top_k must be an integer, got 2.5"),
    ('{"min_p": 2}', "min_p must be in [0, 1], got 2"),
    ('{"repetition_penalty": 0}', "repetition_penalty must be > 0, got 0"),
    ('{"max_new_tokens": 0}', "max_new_tokens must be >= 1, got 0"),
])
def test_a_bad_override_is_refused_naming_the_flag(text: str, message: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_generation_override(text)
    assert str(e.value) == f"--override-generation-config: {message}"


def test_a_bad_folder_or_file_is_refused_naming_the_flag(tmp_path: Path) -> None:
    def refusal(source: str, model_dir: Path | None = None) -> str:
        with pytest.raises(ValueError) as e:
            load_generation_defaults(source, model_dir)
        return str(e.value)

    assert refusal(str(tmp_path / "nowhere")) == (
        "--generation-config: expected 'auto', 'vllm' or a folder holding "
        f"generation_config.json; {str(tmp_path / 'nowhere')!r} is not a folder")
    assert refusal(str(tmp_path)) == \
        f"--generation-config: {tmp_path} has no generation_config.json"
    path = tmp_path / "generation_config.json"
    path.write_text("{")
    assert refusal(str(tmp_path)) == (
        f"--generation-config: {path}: unreadable (Expecting property name enclosed in "
        "double quotes: line 1 column 2 (char 1))")
    write_config(tmp_path, [0.2])
    assert refusal("auto", tmp_path) == \
        f"--generation-config: {path}: expected a JSON object, got list"
    write_config(tmp_path, {"temperature": 0.2, "max_new_tokens": -4})
    assert refusal("auto", tmp_path) == \
        f"--generation-config: {path}: max_new_tokens must be >= 1, got -4"


def test_router_config_refuses_at_once(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as e:
        RouterConfig(generation_config=str(tmp_path))
    assert str(e.value) == f"--generation-config: {tmp_path} has no generation_config.json"
    with pytest.raises(ValueError) as e:
        RouterConfig(override_generation_config={"temp": 0.5})
    assert str(e.value) == f"--override-generation-config: unknown key 'temp'; {KEYS_MESSAGE}"
    config = RouterConfig(override_generation_config={"top_k": 4})
    assert (config.generation_config, config.override_generation_config) == ("auto", {"top_k": 4})


# ---- `pdcluster serve`: command line, environment, config file ---------------------------


def test_the_flags_reach_the_router(captured: list[Any], tmp_path: Path) -> None:
    assert main(["serve", "--model", "tiny"]) == 0
    write_config(tmp_path, {"top_k": 3})
    assert main(["serve", "--model", "tiny", "--generation-config", str(tmp_path),
                 "--override-generation-config", '{"temperature": 0.5}']) == 0
    default, given = (options.router for options in captured)
    assert (default.generation_config, default.override_generation_config) == ("auto", {})
    assert (given.generation_config, given.override_generation_config) == \
        (str(tmp_path), {"temperature": 0.5})


def test_the_environment_and_the_config_file_set_them(
        captured: list[Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "serve.yaml"
    # The file may write the override as a mapping or as its JSON text.
    file.write_text("generation-config: vllm\n"
                    "override-generation-config: {temperature: 0.3, max_new_tokens: 64}\n")
    assert main(["serve", "--model", "tiny", "--config", str(file)]) == 0
    file.write_text("override-generation-config: '{\"top_p\": 0.5}'\n")
    assert main(["serve", "--model", "tiny", "--config", str(file)]) == 0
    monkeypatch.setenv("PDCLUSTER_OVERRIDE_GENERATION_CONFIG", '{"top_k": 5}')
    assert main(["serve", "--model", "tiny", "--config", str(file)]) == 0
    routers = [options.router for options in captured]
    assert [(r.generation_config, r.override_generation_config) for r in routers] == [
        ("vllm", {"temperature": 0.3, "max_new_tokens": 64}),
        ("auto", {"top_p": 0.5}),
        ("auto", {"top_k": 5})]


def test_each_model_of_a_config_file_has_its_own(captured: list[Any], tmp_path: Path) -> None:
    file = tmp_path / "serve.yaml"
    file.write_text("override-generation-config: {temperature: 0.1}\n"
                    "models:\n"
                    "  - model: smollm2\n"
                    "  - model: tiny\n"
                    "    generation-config: vllm\n"
                    "    override-generation-config: {top_k: 2}\n")
    assert main(["serve", "--config", str(file)]) == 0
    (options,) = captured
    assert [(m.router.generation_config, m.router.override_generation_config)
            for m in options.models] == [("auto", {"temperature": 0.1}),
                                         ("vllm", {"top_k": 2})]


@pytest.mark.parametrize(("flags", "message"), [
    (["--override-generation-config", "{temperature: 1}"],
     "error: --override-generation-config: not valid JSON (Expecting property name enclosed "
     "in double quotes: line 1 column 2 (char 1))"),
    (["--override-generation-config", '{"temperature": 0.5, "seed": 1}'],
     f"error: --override-generation-config: unknown key 'seed'; {KEYS_MESSAGE}"),
    (["--generation-config", "vllm", "--override-generation-config", '{"top_p": 0}'],
     "error: --override-generation-config: top_p must be in (0, 1], got 0"),
    (["--generation-config", "{tmp}"],
     "error: --generation-config: {tmp} has no generation_config.json"),
])
def test_a_bad_setting_is_refused_before_anything_starts(
        captured: list[Any], capsys: pytest.CaptureFixture[str], tmp_path: Path,
        flags: list[str], message: str) -> None:
    flags = [flag.replace("{tmp}", str(tmp_path)) for flag in flags]
    assert main(["serve", "--model", "tiny", *flags]) == 2
    assert capsys.readouterr().err.strip() == message.replace("{tmp}", str(tmp_path))
    assert captured == []


# ---- the models ---------------------------------------------------------------------------


def test_the_tiny_model_has_no_sampling_defaults(tiny_dir: str) -> None:
    assert load_generation_defaults("auto", tiny_dir).defaults == {}


def test_offline_generate_without_params_takes_the_defaults() -> None:
    plain = LLM("tiny", cache=CacheConfig(num_blocks=16))
    assert plain.get_default_sampling_params() == SamplingParams()
    llm = LLM("tiny", cache=CacheConfig(num_blocks=16),
              override_generation_config={"temperature": 0, "max_new_tokens": 3})
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0, max_tokens=3)
    prompt = [1200, 3400, 560, 78]
    (out,) = llm.generate(prompt)
    expected = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=3))
    assert out.outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert len(out.outputs[0].token_ids) == 3


SMOLLM2_DEFAULTS = {"temperature": 0.2, "top_p": 0.9}


@pytest.mark.slow
def test_the_converted_smollm2_carries_its_cards_sampling() -> None:
    folder = resolve_model_dir("smollm2")
    written = json.loads((folder / "generation_config.json").read_text())
    assert {k: written[k] for k in ("temperature", "top_p", "bos_token_id", "eos_token_id")} \
        == {**SMOLLM2_DEFAULTS, "bos_token_id": 1, "eos_token_id": 2}
    assert load_generation_defaults("auto", folder).defaults == SMOLLM2_DEFAULTS


@pytest.mark.slow
def test_a_cache_converted_earlier_gets_the_file_without_converting_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = resolve_model_dir("smollm2")
    old = tmp_path / fresh.name
    old.mkdir()
    for f in fresh.iterdir():  # the cache as an earlier version left it, weights linked
        if f.name != "generation_config.json":
            (old / f.name).symlink_to(f)
    monkeypatch.setenv("PDCLUSTER_CACHE", str(tmp_path))
    assert resolve_model_dir("smollm2") == old
    assert (old / "model.safetensors").is_symlink()  # not converted again
    assert json.loads((old / "generation_config.json").read_text()) == \
        json.loads((fresh / "generation_config.json").read_text())
    assert load_generation_defaults("auto", old).defaults == SMOLLM2_DEFAULTS
