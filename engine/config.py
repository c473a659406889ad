"""Frozen engine configuration, validated where it is built."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch

from engine import defaults
from engine.hardware import cpu_paths
from engine.kv_quant import KVCacheDtype, check_kv_cache_dtype

log = logging.getLogger(__name__)

Role = Literal["mixed", "prefill", "decode"]
Policy = Literal["continuous", "static"]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype, device: torch.device | None = None) -> torch.dtype:
    """Map a user-facing dtype name to a torch dtype; `auto` (vLLM's default name) is
    bfloat16 on CUDA and on CPUs with native bf16 (AVX512-BF16 or AMX), float32 on CPUs
    where bf16 would be emulated (`CpuPaths.auto_dtype`); the choice is logged.

    Raises:
        ValueError: the name is not one of the supported dtypes.
    """
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPES.values():
            return dtype
        raise ValueError(f"dtype: {dtype} is not supported; use one of float32, bfloat16, float16")
    if dtype == "auto":
        if device is not None and device.type == "cuda":
            return torch.bfloat16
        paths = cpu_paths()
        log.info("dtype auto: %s (%s)", paths.auto_dtype, paths.describe())
        return _DTYPES[paths.auto_dtype]
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not supported; use auto or one of "
                         f"{sorted(_DTYPES)}")
    return _DTYPES[dtype]


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the runtime needs, read from a Hugging Face `config.json`.

    The options past `bos_token_id` default to a dense Llama layer. `attention_bias` puts a
    bias on q/k/v, `o_proj_bias` on the output projection (Llama and Qwen3 tie both to
    config.json's `attention_bias`; Qwen2 has the first only). `qk_norm`: an RMSNorm over
    each query and key head before RoPE (Qwen3). `moe_layers`: the layers whose MLP is a
    sparse mixture of `num_experts` SwiGLU experts of `moe_intermediate_size`, each token
    routed to its top `num_experts_per_tok` (the others keep a dense MLP of
    `intermediate_size`); `norm_topk_prob` renormalises the chosen experts' softmax weights
    to sum 1; `moe_weights_fp32` keeps them in float32 where the model's dtype is lower
    (Mixtral; Qwen3-MoE rounds them to the model's dtype first).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_model_len: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    o_proj_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_weights_fp32: bool = False
    moe_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        if not self.moe_layers:
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be "
                             f"between 1 and the number of experts ({self.num_experts})")
        if self.moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size must be >= 1, got "
                             f"{self.moe_intermediate_size}")
        if not all(0 <= i < self.num_layers for i in self.moe_layers):
            raise ValueError(f"moe_layers {self.moe_layers} must be layer indices below "
                             f"num_hidden_layers ({self.num_layers})")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing.

    Args:
        block_size: tokens per KV block.
        num_blocks: blocks in the pool; None sizes the pool (`kv_pool_bytes`).
        kv_cache_memory_gb: memory budget for the pool when `num_blocks` is None; None:
            `defaults.KV_CACHE_GB` on CPU, `gpu_memory_utilization` on CUDA.
        gpu_memory_utilization: on CUDA, the share of the GPU's memory this engine may
            hold (weights + KV pool) when `kv_cache_memory_gb` is None.
        enable_prefix_caching: reuse full blocks whose chained token hash matches.
        kv_cache_dtype: `auto` (the model's dtype) or `int8` (symmetric int8 with a scale per
            token and KV head, `engine/kv_quant.py`: about 2x the blocks of bf16 at one
            budget, 3.8x those of fp32).
    """

    block_size: int = defaults.BLOCK_SIZE
    num_blocks: int | None = None
    kv_cache_memory_gb: float | None = defaults.KV_CACHE_GB
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: KVCacheDtype = "auto"

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.kv_cache_memory_gb is not None and self.gpu_memory_utilization is not None:
            raise ValueError("kv_cache_memory_gb and gpu_memory_utilization both size the KV "
                             "pool: give one")
        check_kv_cache_dtype(self.kv_cache_dtype)


def kv_pool_bytes(cache: CacheConfig, device_type: str, total_bytes: int = 0,
                  held_bytes: int = 0) -> int:
    """The KV pool's memory budget on a device.

    On CPU it is `kv_cache_memory_gb` (default `defaults.KV_CACHE_GB`); a GPU share means
    nothing there. On CUDA an absolute `kv_cache_memory_gb` wins, else the pool gets what
    `gpu_memory_utilization` (default `defaults.GPU_MEMORY_UTILIZATION`) of the device
    leaves after what this process holds already (the weights), as in vLLM.

    Args:
        cache: the sizing settings.
        device_type: `cpu` or `cuda`.
        total_bytes: the accelerator's memory (CUDA).
        held_bytes: what this process holds on it now (CUDA).

    Raises:
        ValueError: a GPU share on CPU, or a share too small for the weights.
    """
    if device_type != "cuda":
        if cache.gpu_memory_utilization is not None:
            raise ValueError("gpu_memory_utilization sizes the KV pool from accelerator "
                             "memory, but this engine runs on CPU: give kv_cache_memory_gb")
        return int((cache.kv_cache_memory_gb or defaults.KV_CACHE_GB) * 2**30)
    if cache.kv_cache_memory_gb is not None:
        return int(cache.kv_cache_memory_gb * 2**30)
    share = cache.gpu_memory_utilization or defaults.GPU_MEMORY_UTILIZATION
    budget = int(share * total_bytes) - held_bytes
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization {share:g} of {total_bytes / 2**30:.1f} GiB "
                         f"leaves nothing for the KV pool beside the "
                         f"{held_bytes / 2**30:.1f} GiB this worker holds: raise it")
    return budget


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching policy.

    Args:
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
        max_num_seqs: most requests running at once.
        enable_chunked_prefill: split prompts longer than the remaining budget over steps.
        role: `mixed` (prefill and decode), `prefill` (stop after the first token, keep the
            KV for transfer) or `decode` (also accepts requests whose KV arrives remotely).
        policy: `continuous` batching, or `static` (whole batches in lock-step, for
            comparison benchmarks).
    """

    max_num_batched_tokens: int = defaults.MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = defaults.MAX_NUM_SEQS
    enable_chunked_prefill: bool = True
    role: Role = "mixed"
    policy: Policy = "continuous"

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.role not in ("mixed", "prefill", "decode"):
            raise ValueError(f"role must be mixed, prefill or decode, got {self.role!r}")
        if self.policy not in ("continuous", "static"):
            raise ValueError(f"policy must be continuous or static, got {self.policy!r}")
