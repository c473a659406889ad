"""Qwen3, Mixtral and Qwen3-MoE against `transformers` on tiny random models: the same
logits (fp32, prefill and decode), the same greedy tokens over a batch that mixes prompt
chunks and decodes in one step, bf16 close to `transformers`' bf16, and clear errors for
what the engine does not run."""

from __future__ import annotations

import copy
import json
import random
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, PretrainedConfig

import engine.llm_engine as llm_engine
import engine.model_loader as model_loader
from engine import LLM, CacheConfig, SamplingParams, SchedulerConfig
from engine.model_loader import (
    ModelLoadError,
    load_model,
    read_model_config,
    resolve_model_dir,
)
from engine.models.moe import SparseMoeBlock
from tests.conftest import assert_pool_free

LOGIT_TOL = 1e-4
COMMON = {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
          "initializer_range": 0.2}  # a wide init spreads logits: greedy ties are unlikely
# name -> transformers' config and model classes, and the config's own keys.
FAMILIES: dict[str, tuple[str, str, dict[str, object]]] = {
    # head_dim 32, not hidden / heads = 16; q/k/v and o_proj biases; a tied LM head.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {
        "intermediate_size": 128, "head_dim": 32, "attention_bias": True,
        "tie_word_embeddings": True}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        "intermediate_size": 96, "num_local_experts": 4, "num_experts_per_tok": 2}),
    # Layers 0 and 2 sparse, 1 dense of intermediate_size.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "intermediate_size": 128, "moe_intermediate_size": 48, "num_experts": 8,
        "num_experts_per_tok": 2, "mlp_only_layers": [1], "norm_topk_prob": True,
        "head_dim": 32}),
    # Only layer 1 sparse (decoder_sparse_step 2); top-3 weights not renormalised.
    "qwen3_moe_unnormed": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 6,
        "num_experts_per_tok": 3, "decoder_sparse_step": 2, "norm_topk_prob": False}),
}
MOE_LAYERS = {"qwen3": (), "mixtral": (0, 1, 2), "qwen3_moe": (0, 2), "qwen3_moe_unnormed": (1,)}


@dataclass
class Family:
    name: str
    folder: Path
    hf: torch.nn.Module  # transformers' model, fp32
    llm: LLM  # ours, fp32


def _prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in lengths]


def _make_folder(name: str, out: Path) -> torch.nn.Module:
    """A tiny random model of family `name` saved by transformers, with tiny's tokenizer.
    Norm weights (ones) and biases (zeros) are randomised too, so a q_norm swapped with a
    k_norm or a dropped bias shows."""
    config_class, model_class, keys = FAMILIES[name]
    tiny = resolve_model_dir("tiny")
    vocab = json.loads((tiny / "config.json").read_text())
    config = getattr(transformers, config_class)(
        vocab_size=vocab["vocab_size"], bos_token_id=vocab["bos_token_id"],
        eos_token_id=vocab["eos_token_id"], **COMMON, **keys)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).float().eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("bias"):
                param.normal_(0.0, 0.2)
            elif "norm" in param_name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, out / f.name)
    return model


@pytest.fixture(scope="module", autouse=True)
def _tiny_tokenizer_parsed_once() -> Iterator[None]:
    """The families' folders hold copies of tiny's tokenizer files: engines on them take
    copies of tiny's parsed tokenizer (parsing one is most of building a tiny engine)."""
    load = llm_engine.load_tokenizer  # tests/conftest.py's, a copy of one parse per folder
    tiny = resolve_model_dir("tiny")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llm_engine, "load_tokenizer", lambda model_dir: load(tiny))
        yield


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Family]:
    """Each family's model, made on first use and kept for the module."""
    built: dict[str, Family] = {}

    def get(name: str) -> Family:
        if name not in built:
            folder = tmp_path_factory.mktemp(name)
            hf = _make_folder(name, folder)
            built[name] = Family(name, folder, hf,
                                 LLM(str(folder), cache=CacheConfig(num_blocks=64)))
        return built[name]
    return get


@pytest.fixture(params=list(FAMILIES))
def family(request: pytest.FixtureRequest, families: Callable[[str], Family]) -> Family:
    return families(request.param)


@pytest.fixture(params=[name for name in FAMILIES if name != "qwen3"])
def moe_family(request: pytest.FixtureRequest, families: Callable[[str], Family]) -> Family:
    return families(request.param)


def _record_logits(llm: LLM) -> list[torch.Tensor]:
    """Every `[rows, vocab]` logits the engine's model computes from now on."""
    seen: list[torch.Tensor] = []
    compute = type(llm.engine.model).compute_logits.__get__(llm.engine.model)
    llm.engine.model.compute_logits = lambda hidden: seen.append(compute(hidden)) or seen[-1]
    return seen


def _logit_gap(llm: LLM, hf: torch.nn.Module, prompt: list[int], steps: int) -> float:
    """Max |logit difference| over the prompt's last position (prefill) and `steps - 1`
    decode steps, against transformers over the same tokens."""
    seen = _record_logits(llm)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=steps,
                                                ignore_eos=True))
    del llm.engine.model.compute_logits
    tokens = out[0].outputs[0].token_ids
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    ours = torch.cat(seen)
    assert ours.shape == expected.shape == (steps, hf.config.vocab_size)
    return (ours - expected).abs().max().item()


def test_the_record_has_the_familys_layers(family: Family) -> None:
    cfg = family.llm.engine.model.cfg
    assert cfg.head_dim == family.hf.model.layers[0].self_attn.head_dim
    assert cfg.moe_layers == MOE_LAYERS[family.name]
    assert cfg.qk_norm == family.name.startswith("qwen3")
    layers = family.llm.engine.model.layers
    assert [i for i, layer in enumerate(layers) if isinstance(layer.mlp, SparseMoeBlock)] == \
        list(MOE_LAYERS[family.name])
    assert all((layer.gate_up_proj is None) == (layer.mlp is not None) for layer in layers)


def test_fp32_logits_match_transformers(family: Family) -> None:
    """Prefill and 7 decode steps, on the CPU kernels' glue and on plain torch ops."""
    prompt = _prompts((19,), seed=1)[0]
    assert _logit_gap(family.llm, family.hf, prompt, steps=8) < LOGIT_TOL
    layers = family.llm.engine.model.layers
    kernels = [layer.kernels for layer in layers]
    for layer in layers:
        layer.kernels = None
    try:
        assert _logit_gap(family.llm, family.hf, prompt, steps=8) < LOGIT_TOL
    finally:
        for layer, k in zip(layers, kernels, strict=True):
            layer.kernels = k
    assert_pool_free(family.llm.engine)


def test_mixed_batch_greedy_matches_generate(family: Family,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Three prompts of 5, 23 and 41 tokens, 20 new tokens each, at a budget of 16 tokens
    a step: steps hold prompt chunks beside decodes, each MoE expert taking rows of several
    requests."""
    llm = LLM(str(family.folder), cache=CacheConfig(block_size=8, num_blocks=64),
              scheduler=SchedulerConfig(max_num_batched_tokens=16))
    query_lens: list[list[int]] = []
    begin = llm.engine.runner.attn.begin_step
    monkeypatch.setattr(llm.engine.runner.attn, "begin_step",
                        lambda layout: (query_lens.append(list(layout.query_lens)),
                                        begin(layout))[1])
    prompts = _prompts((5, 23, 41), seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert any(max(lens) > 1 and min(lens) == 1 for lens in query_lens)  # chunk + decode
    assert any(len(lens) == 3 for lens in query_lens)
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.inference_mode():
            expected = family.hf.generate(
                torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20,
                do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):]
        assert out.outputs[0].token_ids == expected.tolist()
    assert_pool_free(llm.engine)


# bf16 against transformers' own bf16 on the same weights: both round at the same modules,
# but the matmuls and the CPU kernels' norms sum in another order, so the logits part by a
# few bf16 roundings. Measured: up to 3.8 % of the largest |logit| (Mixtral), under 2.5 %
# for the others; a wrong routing weight or a lost norm moves them by far more.
BF16_REL_TOL = 1 / 16


def test_bf16_runs_close_to_transformers_bf16(family: Family) -> None:
    llm = LLM(str(family.folder), dtype="bfloat16", cache=CacheConfig(num_blocks=16))
    seen = _record_logits(llm)
    prompt = _prompts((13,), seed=3)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2,
                                                ignore_eos=True))
    hf16 = copy.deepcopy(family.hf).to(torch.bfloat16)
    with torch.inference_mode():
        expected = hf16(torch.tensor([prompt])).logits[0, -1].float()
    assert seen[0].dtype == torch.bfloat16
    tol = BF16_REL_TOL * expected.abs().max().item()
    assert (seen[0][0].float() - expected).abs().max().item() < tol
    top2 = expected.topk(2).values
    if top2[0] - top2[1] > 2 * tol:
        assert out[0].outputs[0].token_ids[0] == int(expected.argmax())
    assert_pool_free(llm.engine)


def _config_copy(src: Path, dst: Path, **changes: object) -> Path:
    """`src`'s folder with config.json keys changed (None removes one)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        config.pop(key) if value is None else config.__setitem__(key, value)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_config_json_read_as_is_gives_transformers_record(
        family: Family, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, hf = read_model_config(family.folder)
    assert not isinstance(hf, PretrainedConfig)  # every key there: read as JSON
    # The other name transformers reads the expert count under.
    renamed = {"num_local_experts": None, "num_experts": 8} if family.name == "qwen3_moe" \
        else {}
    assert read_model_config(_config_copy(family.folder, tmp_path / "m", **renamed))[0] == cfg
    monkeypatch.setattr(model_loader, "_hf_config", AutoConfig.from_pretrained)
    assert read_model_config(family.folder)[0] == cfg


@pytest.mark.parametrize(("name", "key", "field", "default"), [
    ("qwen3", "head_dim", "head_dim", 128),
    ("mixtral", "num_local_experts", "num_experts", 8),
    ("qwen3_moe", "moe_intermediate_size", "moe_intermediate_size", 768),
    ("qwen3_moe", "norm_topk_prob", "norm_topk_prob", False),
    ("qwen3_moe", "num_key_value_heads", "num_kv_heads", 4),  # not num_attention_heads
])
def test_a_family_key_the_file_leaves_out_takes_transformers_default(
        families: Callable[[str], Family], tmp_path: Path, name: str, key: str, field: str,
        default: object) -> None:
    folder = _config_copy(families(name).folder, tmp_path / "m", **{key: None})
    cfg, hf = read_model_config(folder)
    assert isinstance(hf, PretrainedConfig)
    assert getattr(cfg, field) == default


def test_stacked_expert_layout_loads_the_same_weights(moe_family: Family,
                                                      tmp_path: Path) -> None:
    """transformers' in-memory layout, `experts.gate_up_proj` `[E, 2I, H]` and
    `experts.down_proj` `[E, H, I]`, is read as the per-expert one."""
    family = moe_family
    model = family.hf
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    folder = _config_copy(family.folder, tmp_path / "m")
    save_file(state, folder / "model.safetensors")
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in load_file(
        folder / "model.safetensors"))
    cfg, hf = read_model_config(folder)
    ours = load_model(folder, cfg, hf, torch.float32, torch.device("cpu")).state_dict()
    assert ours.keys() == family.llm.engine.model.state_dict().keys()
    assert all(torch.equal(ours[k], v) for k, v in family.llm.engine.model.state_dict().items())


def _without(folder: Path, dst: Path, drop: Callable[[str], bool]) -> Path:
    out = _config_copy(folder, dst)
    state = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in state.items() if not drop(k)}, out / "model.safetensors")
    return out


def test_a_missing_expert_weight_is_a_clear_error(families: Callable[[str], Family],
                                                  tmp_path: Path) -> None:
    folder = _without(families("mixtral").folder, tmp_path / "m",
                      lambda k: k == "model.layers.1.block_sparse_moe.experts.2.w3.weight")
    with pytest.raises(ModelLoadError, match=r"lack 1 tensors.*layers\.1\.mlp\.experts\.2\."
                                             r"gate_up_proj"):
        LLM(str(folder))


def test_an_unsupported_architecture_is_a_clear_error(tmp_path: Path) -> None:
    folder = _config_copy(resolve_model_dir("tiny"), tmp_path / "m",
                          architectures=["DeepseekV3ForCausalLM"])
    with pytest.raises(ModelLoadError, match=r"architecture \('DeepseekV3ForCausalLM',\) is "
                                             r"not supported; use one of .*Qwen3MoeForCausalLM"):
        LLM(str(folder))


@pytest.mark.parametrize(("changes", "message"), [
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok \(9\) must be between 1 and the "
                                 r"number of experts \(8\)"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step must be an integer >= 1, got 0"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
])
def test_an_impossible_moe_config_is_a_clear_error(families: Callable[[str], Family],
                                                   tmp_path: Path, changes: dict,
                                                   message: str) -> None:
    folder = _config_copy(families("qwen3_moe").folder, tmp_path / "m", **changes)
    with pytest.raises(ModelLoadError, match=message):
        read_model_config(folder)


def test_a_sliding_window_bounds_the_context(families: Callable[[str], Family],
                                             tmp_path: Path) -> None:
    """The engine attends the whole context: equal to a sliding window only within it.
    Qwen's windows count only where `use_sliding_window`."""
    folder = _config_copy(families("mixtral").folder, tmp_path / "m", sliding_window=64)
    assert read_model_config(folder)[0].max_model_len == 64
    with pytest.raises(ValueError, match=r"max_model_len \(128\) exceeds the model's "
                                         r"sliding_window"):
        read_model_config(folder, max_model_len=128)
    qwen3 = families("qwen3").folder
    unused = _config_copy(qwen3, tmp_path / "q", sliding_window=64, use_sliding_window=False)
    assert read_model_config(unused)[0].max_model_len == 256
    used = _config_copy(qwen3, tmp_path / "u", sliding_window=64, use_sliding_window=True)
    assert read_model_config(used)[0].max_model_len == 64


def test_weights_are_fused_a_layer_at_a_time(family: Family) -> None:
    """`_fused` yields each layer's tensors, fused, before it fuses the next layer's, then
    the rest: a tensor-parallel rank keeps its slice of each as it comes and holds one
    layer's fused tensors at most, never the whole model's. Every name comes out once, and
    they are the model's."""
    cfg, _ = read_model_config(family.folder)
    names = [name for name, _ in model_loader._fused(
        load_file(family.folder / "model.safetensors"), cfg)]
    layers = [int(name.split(".")[1]) for name in names if name.startswith("layers.")]
    first_other = next(i for i, name in enumerate(names) if not name.startswith("layers."))
    assert layers == sorted(layers) and len(layers) == first_other
    assert sorted(set(layers)) == list(range(cfg.num_layers))
    assert len(names) == len(set(names))
    assert set(names) == set(family.llm.engine.model.state_dict())
