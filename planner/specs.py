"""What the analytic step-time model is given: an accelerator and a model's shapes.

Accelerators come from the built-in table (`planner/data/accelerators.yaml`, vendor
datasheet figures with their sources), from a user's YAML file with the same keys, or, for
`cpu`, from this machine's measured matmul FLOP/s and memory read bandwidth. Model shapes
come from a Hugging Face `config.json` (Llama, Qwen2, Mistral, Mixtral-style MoE; GQA), or
from one of the public configs shipped in `planner/data/models/`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

# Bytes per element of the dtypes a spec or a config may name.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}


@dataclass(frozen=True)
class Accelerator:
    """One device and the analytic model's constants for it.

    Args:
        name: the table's name, or the spec file's.
        bf16_tflops: dense bf16 (and fp16) throughput, 10^12 FLOP/s.
        fp8_tflops: dense fp8 throughput (None: no fp8 units).
        memory_gb: device memory as the datasheet states it: "80 GB" of HBM is 80 GiB
            (2^30 bytes), as vLLM's `total_gpu_memory` reports it (79.2 GiB visible).
        memory_bandwidth_gbs: device memory bandwidth, 10^9 bytes/s.
        link: the scale-up link's name.
        link_bandwidth_gbs: its bidirectional bandwidth per device, 10^9 bytes/s (on a
            mesh the sum over the device's `devices_per_node - 1` peers).
        link_topology: `switch` (NVLink through NVSwitch, PCIe through a PCIe switch:
            a device's whole bandwidth reaches any peer) or `mesh` (AMD's xGMI: one link
            per peer, a pair gets `link_bandwidth_gbs / (devices_per_node - 1)`).
        network_gbps: scale-out network per device, 10^9 bits/s (the KV transfer).
        devices_per_node: devices in one server.
        source: where the figures come from.
        fp32_tflops: dense fp32 throughput (the CPU's measured one; on a GPU None:
            fp32 is not a serving dtype the table prices).
        gemm_efficiency: the fraction of peak FLOP/s a large GEMM reaches.
        gemm_half_tokens: the token count at which a GEMM reaches half of that (its
            efficiency is `gemm_efficiency * T / (T + gemm_half_tokens)`: few rows leave
            tiles and cores idle; one row, a GEMV, is priced at the peak).
        gemm_weight_passes: passes over the weights a GEMM of more than
            `gemm_packed_rows` rows makes (a CPU BLAS packs its operand, read, write, read
            again, where a one-row product streams it once; a GPU reads it once).
        gemm_packed_rows: up to this many rows a GEMM reads its weights once: a one-row
            product streams them, and an engine may keep them packed from load for a few
            rows (this one's fp32 linears of 2-16 rows on AVX-512 CPUs, oneDNN's
            prepacked GEMM).
        attention_efficiency: the fraction of peak FLOP/s attention reaches.
        bandwidth_efficiency: the fraction of memory bandwidth a weight or KV read reaches.
        step_overhead_ms: fixed time per step (scheduling, launches, sampling).
        layer_overhead_us: fixed time per layer per step (kernel launches or, on a CPU,
            the interpreter between ops).
        link_latency_us: latency of one all-reduce.
        transfer_latency_ms: fixed cost of one KV transfer.
        memory_utilization: the fraction of device memory the engine may use (vLLM's
            `gpu_memory_utilization`, default 0.9).
        collective_efficiency: the fraction of the link's bandwidth an all-reduce's bus
            bandwidth reaches.
        runtime_reserve_gb: GiB per device outside the weights, KV and activations: the
            CUDA context, cuBLAS and attention workspaces, CUDA graphs; as much again with
            tensor parallelism (NCCL's buffers).
    """

    name: str
    bf16_tflops: float
    memory_gb: float
    memory_bandwidth_gbs: float
    fp8_tflops: float | None = None
    fp32_tflops: float | None = None
    link: str = "none"
    link_bandwidth_gbs: float = 0.0
    link_topology: str = "switch"
    network_gbps: float = 100.0
    devices_per_node: int = 8
    source: str = ""
    gemm_efficiency: float = 0.7
    gemm_half_tokens: float = 64.0
    gemm_weight_passes: float = 1.0
    gemm_packed_rows: int = 1
    attention_efficiency: float = 0.5
    bandwidth_efficiency: float = 0.8
    step_overhead_ms: float = 2.0
    layer_overhead_us: float = 0.0
    link_latency_us: float = 10.0
    transfer_latency_ms: float = 1.0
    memory_utilization: float = 0.9
    # NCCL all-reduce on DGX H100 reaches ~360 GB/s bus bandwidth of NVLink 4's 450 GB/s
    # per direction (nccl-tests, without NVLS): 0.8.
    collective_efficiency: float = 0.8
    # vLLM's memory profile of Llama-3-8B on an H100 (vllm-project/vllm PR #10511):
    # non_torch_memory 1.79 GiB at TP 1, 3.58 GiB at TP 2.
    runtime_reserve_gb: float = 1.8

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "link", "link_topology", "source") or value is None:
                continue
            if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                raise ValueError(f"hardware {self.name}: {f.name} must be a number >= 0, "
                                 f"got {value!r}")
        for key in ("bf16_tflops", "memory_gb", "memory_bandwidth_gbs", "devices_per_node"):
            if not getattr(self, key) > 0:
                raise ValueError(f"hardware {self.name}: {key} must be > 0")
        if not 0 < self.memory_utilization <= 1:
            raise ValueError(f"hardware {self.name}: memory_utilization must be in (0, 1]")
        if not 0 < self.collective_efficiency <= 1:
            raise ValueError(f"hardware {self.name}: collective_efficiency must be in (0, 1]")
        if self.link_topology not in ("switch", "mesh"):
            raise ValueError(f"hardware {self.name}: link_topology must be switch or mesh, "
                             f"got {self.link_topology!r}")

    def collective_bandwidth(self, tp: int) -> float:
        """GB/s one rank of a `tp`-way all-reduce sends (and receives) at, before the
        collective's efficiency. Through a switch: half the device's bidirectional link,
        whatever the peers. On a mesh: half of one pair's link for each of the `tp - 1`
        peers it reaches directly (MI300X: 896 / 7 = 128 GB/s a pair; TP 2 gets 64 GB/s a
        direction, TP 8 all 448)."""
        if self.link_topology == "mesh":
            pair = self.link_bandwidth_gbs / max(self.devices_per_node - 1, 1)
            return (tp - 1) * pair / 2
        return self.link_bandwidth_gbs / 2

    def reserve_bytes(self, tp: int) -> float:
        """Bytes per device the runtime holds (`runtime_reserve_gb`, twice with TP)."""
        return self.runtime_reserve_gb * 2**30 * (2 if tp > 1 else 1)

    def flops(self, dtype: str) -> float:
        """Peak dense FLOP/s in `dtype`.

        Raises:
            ValueError: the device has no figure for it.
        """
        tflops = {"bfloat16": self.bf16_tflops, "float16": self.bf16_tflops,
                  "fp8": self.fp8_tflops, "float32": self.fp32_tflops}.get(dtype)
        if tflops is None:
            raise ValueError(f"hardware {self.name} has no {dtype} FLOP/s figure")
        return tflops * 1e12


def accelerator_table() -> dict[str, dict[str, Any]]:
    """The built-in table, by name."""
    text = resources.files("planner").joinpath("data/accelerators.yaml").read_text()
    return yaml.safe_load(text)


def accelerator_from_dict(name: str, spec: Any) -> Accelerator:
    """An accelerator from a spec's mapping.

    Raises:
        ValueError: not a mapping, an unknown key, a missing one, or a bad value; the
            message names the key.
    """
    if not isinstance(spec, dict):
        raise ValueError(f"hardware {name}: expected a mapping of keys to values, "
                         f"got {type(spec).__name__}")
    known = {f.name for f in fields(Accelerator)} - {"name"}
    if unknown := sorted(set(spec) - known):
        raise ValueError(f"hardware {name}: unknown key {unknown[0]!r} "
                         f"(known: {', '.join(sorted(known))})")
    if missing := [k for k in ("bf16_tflops", "memory_gb", "memory_bandwidth_gbs")
                   if k not in spec]:
        raise ValueError(f"hardware {name}: missing key {missing[0]!r}")
    return Accelerator(name=name, **{key: _number(value) for key, value in spec.items()})


def _number(value: Any) -> Any:
    """YAML 1.1 reads `1e9` (no dot) as a string: take it as the number it spells."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def load_accelerator(name_or_path: str, torch_threads: int = 1) -> Accelerator:
    """`cpu`, a name from the built-in table, or a YAML spec file.

    A spec file holds one accelerator's keys at its top level (and `name`), or a mapping of
    one name to them.

    Raises:
        ValueError: an unknown name, an unreadable file, or a bad spec.
    """
    if name_or_path == "cpu":
        return cpu_accelerator(torch_threads)
    table = accelerator_table()
    if name_or_path in table:
        return accelerator_from_dict(name_or_path, table[name_or_path])
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"hardware {name_or_path!r}: not cpu, a file, or one of "
                         f"{', '.join(table)}")
    try:
        spec = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"hardware {path}: cannot read it: {e}") from e
    if isinstance(spec, dict) and len(spec) == 1 and isinstance(next(iter(spec.values())), dict):
        (name, spec), = spec.items()
        return accelerator_from_dict(str(name), spec)
    if isinstance(spec, dict):
        spec = dict(spec)
        return accelerator_from_dict(str(spec.pop("name", path.stem)), spec)
    return accelerator_from_dict(path.stem, spec)


def cpu_accelerator(torch_threads: int = 1) -> Accelerator:
    """This machine with `torch_threads` threads: its measured fp32 matmul FLOP/s and read
    bandwidth (`engine.hardware.measure_peaks`, which already reach what they reach: an
    efficiency of 1), its memory, and the constants of the CPU engine."""
    import torch

    from engine.hardware import cpu_features, cpu_paths, measure_peaks
    from engine.models.llama import BlasLinear

    before = torch.get_num_threads()
    torch.set_num_threads(torch_threads)
    try:
        # Best of two rounds: on a shared machine a round can land on a busy moment.
        rounds = [measure_peaks(repeats=5) for _ in range(2)]
        peaks = {key: max(r[key] for r in rounds) for key in ("flops", "bandwidth")}
    finally:
        torch.set_num_threads(before)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpu = cpu_features()
    packed_rows = BlasLinear.SMALL_ROWS if cpu_paths().fp32_small_rows else 1
    # A "device" is one worker's share of the host: its cores and its part of the memory
    # (the workers of one host must fit it together, each KV pool sized from its share).
    devices = max(cpu.cores // torch_threads, 1)
    return Accelerator(
        name="cpu", bf16_tflops=peaks["flops"] / 1e12, fp32_tflops=peaks["flops"] / 1e12,
        memory_gb=memory / 2**30 / devices, memory_bandwidth_gbs=peaks["bandwidth"] / 1e9,
        link="shared memory", link_bandwidth_gbs=peaks["bandwidth"] / 1e9,
        network_gbps=8 * peaks["bandwidth"] / 1e9 / 2,  # a copy: read and write
        devices_per_node=devices,
        source=f"measured on {cpu.model} with {torch_threads} thread(s)",
        gemm_packed_rows=packed_rows, **CPU_CONSTANTS)


# The CPU engine's constants: the GPU defaults' efficiencies (70 % of the measured
# 1024-square matmul peak for a large GEMM, 80 % of the measured read bandwidth), a GEMM
# at half of that at 32 rows and, above the rows it keeps packed from load
# (`gemm_packed_rows`, set by `cpu_accelerator` from the engine's fp32 path), packing its
# weights per call (three passes over them); every layer costs ~20 Python-level ops
# (norms, rotary, the paged-KV write, the residual adds), about 0.1 ms together. Chosen
# looking at measured profiles of SmolLM2 on a 2-core Xeon (docs/benchmarks.md: the
# check is not blind).
CPU_CONSTANTS: dict[str, float] = {
    "gemm_efficiency": 0.7, "gemm_half_tokens": 32.0, "gemm_weight_passes": 3.0,
    "attention_efficiency": 0.5, "bandwidth_efficiency": 0.8, "step_overhead_ms": 5.0,
    "layer_overhead_us": 100.0, "link_latency_us": 0.0, "transfer_latency_ms": 1.0,
    "memory_utilization": 0.5, "collective_efficiency": 1.0, "runtime_reserve_gb": 0.0}


@dataclass(frozen=True)
class ModelShape:
    """What the step-time model needs of a model, from its `config.json`.

    Args:
        name: what profiles call the model.
        architecture: `architectures[0]`.
        num_layers: decoder layers.
        hidden_size: model width.
        intermediate_size: the MLP's width (one expert's, in an MoE).
        num_heads: query heads.
        num_kv_heads: key/value heads (GQA: fewer than `num_heads`).
        head_dim: size of one head.
        vocab_size: rows of the embedding and the LM head.
        tie_word_embeddings: the LM head is the embedding.
        num_experts: MLP experts per layer (1: dense).
        experts_per_token: experts each token is routed to.
        max_position_embeddings: longest context.
        dtype: the checkpoint's dtype.
    """

    name: str
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    num_experts: int = 1
    experts_per_token: int = 1
    max_position_embeddings: int = 8192
    dtype: str = "bfloat16"

    @property
    def model_id(self) -> str:
        """The shape as a measured profile names it (`planner.measure.model_id`)."""
        return (f"{self.architecture}:L{self.num_layers}:H{self.hidden_size}:"
                f"I{self.intermediate_size}:A{self.num_heads}/{self.num_kv_heads}x"
                f"{self.head_dim}:V{self.vocab_size}")

    @property
    def attention_params(self) -> int:
        """Weights of one layer's q, k, v and o projections."""
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        return self.hidden_size * (q + 2 * kv) + q * self.hidden_size

    @property
    def expert_params(self) -> int:
        """Weights of one expert's (or the dense) gate, up and down projections."""
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def router_params(self) -> int:
        return self.hidden_size * self.num_experts if self.num_experts > 1 else 0

    @property
    def num_params(self) -> int:
        """All weights (norms left out: under 0.01 %)."""
        layer = self.attention_params + self.num_experts * self.expert_params + \
            self.router_params
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.num_layers * layer + self.vocab_size * self.hidden_size + head

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[kv_dtype]


SHIPPED_MODELS = ("llama-3-8b", "llama-3-70b", "qwen2.5-7b", "mixtral-8x7b", "smollm2")


def load_model_shape(name_or_path: str) -> ModelShape:
    """A shipped config's name, a `config.json`, or a directory holding one.

    Raises:
        ValueError: no such file, or a config without a field the model needs (named).
    """
    if name_or_path in SHIPPED_MODELS:
        text = resources.files("planner").joinpath(f"data/models/{name_or_path}.json").read_text()
        return model_shape(json.loads(text), name_or_path)
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"model config {name_or_path!r}: not one of "
                         f"{', '.join(SHIPPED_MODELS)} nor a readable config.json: {e}") from e
    return model_shape(config, path.parent.name if path.name == "config.json" else path.stem)


def model_shape(config: dict[str, Any], name: str) -> ModelShape:
    """The shape a Hugging Face config describes.

    Raises:
        ValueError: a missing or non-positive field, named.
    """
    if not isinstance(config, dict):
        raise ValueError(f"model config {name}: expected a JSON object")

    def need(key: str) -> int:
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"model config {name}: {key} must be an integer > 0, got {value!r}")
        return value

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    kv_heads = need("num_key_value_heads") if "num_key_value_heads" in config else heads
    if heads % kv_heads:
        raise ValueError(f"model config {name}: num_attention_heads ({heads}) must be a "
                         f"multiple of num_key_value_heads ({kv_heads})")
    experts = need("num_local_experts") if "num_local_experts" in config else 1
    per_token = need("num_experts_per_tok") if experts > 1 else 1
    dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    return ModelShape(
        name=name, architecture=(config.get("architectures") or ["LlamaForCausalLM"])[0],
        num_layers=need("num_hidden_layers"), hidden_size=hidden,
        intermediate_size=need("intermediate_size"), num_heads=heads, num_kv_heads=kv_heads,
        head_dim=need("head_dim") if config.get("head_dim") else hidden // heads,
        vocab_size=need("vocab_size"),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        num_experts=experts, experts_per_token=per_token,
        max_position_embeddings=need("max_position_embeddings")
        if "max_position_embeddings" in config else 8192,
        dtype=dtype if dtype in DTYPE_BYTES else "bfloat16")


def tp_problem(shape: ModelShape, tp: int) -> str | None:
    """Why `shape` cannot be split `tp` ways (None: it can). Every split dimension must
    divide: the query heads, the KV heads (or `tp` a multiple of them: each rank keeps a
    copy of its group's), the MLP's (each expert's) width, and the vocabulary as vLLM pads
    it (to a multiple of 64, then `divide(padded, tp)` in `VocabParallelEmbedding`)."""
    if shape.num_heads % tp:
        return f"does not divide the {shape.num_heads} attention heads"
    if shape.num_kv_heads % tp and tp % shape.num_kv_heads:
        return f"neither divides nor is a multiple of the {shape.num_kv_heads} KV heads"
    padded_vocab = -(-shape.vocab_size // 64) * 64
    for what, size in (("MLP width", shape.intermediate_size),
                       ("padded vocabulary", padded_vocab)):
        if size % tp:
            return f"does not divide the {size} {what}"
    return None


def experts_touched(shape: ModelShape, tokens: int) -> float:
    """Expected distinct experts a layer reads for `tokens` tokens (uniform routing)."""
    if shape.num_experts == 1:
        return 1.0
    miss = (1 - shape.experts_per_token / shape.num_experts) ** tokens
    return shape.num_experts * (1 - miss) if tokens > 0 else 0.0
