"""Llama-style decoders over a paged KV cache: the Llama family (Llama, Mistral, Qwen2,
SmolLM), Qwen3 (an RMSNorm over each query and key head before RoPE), and the sparse
mixture-of-experts Mixtral and Qwen3-MoE (`engine.models.moe` in place of the dense MLP).
One layer class takes each family's options from `ModelConfig`."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend
from engine.config import ModelConfig
from engine.hardware import cpu_paths
from engine.kernels import cpu_kernels
from engine.kv_cache import KVCache
from engine.models.moe import SparseMoeBlock, silu_mul
from engine.models.rope import RotaryEmbedding, apply_rope
from engine.parallel import (
    ParallelGroup,
    gather_logits,
    shard_config,
    vocab_parallel_embedding,
    vocab_shard_rows,
)

LayerHook = Callable[[int], None]


class BlasLinear:
    """A CPU fp32 linear on a row-major `[in, out]` weight: numpy's BLAS (OpenBLAS) and,
    where `small_rows`, oneDNN's fp32 GEMM on a copy prepacked at load for 2 to
    `SMALL_ROWS` rows.

    OpenBLAS on this layout is the fastest fp32 kernel at one row (decode at batch 1) and
    for large row counts (prefill chunks) at the engine's threads (BLAS on every core, torch
    on one fewer). In between it is slow: 2 to 16 rows of a SmolLM2 layer cost 3-5x one row
    on an Intel Xeon with AVX-512, and each call hands the work to BLAS threads that slept
    since the last one. Those are a speculative verify step's rows (K + 1 per request) and
    small batches'; oneDNN's prepacked GEMM on the compute thread takes them at 2.2-3x one
    row, and decode steps of 8 sequences 0.75x OpenBLAS's time (docs/benchmarks.md). The
    parameter becomes a `[out, in]` view of the transposed storage; the prepacked copy is a
    second one, opaque to torch.

    Args:
        weight: a CPU float32 `[out, in]` parameter, re-laid in place.
        bias: optional `[out]`.
        small_rows: keep oneDNN's prepacked copy for 2 to `SMALL_ROWS` rows.
    """

    SMALL_ROWS = 16

    def __init__(self, weight: nn.Parameter, bias: torch.Tensor | None = None,
                 small_rows: bool = False) -> None:
        transposed = weight.data.T.contiguous()  # [in, out]
        weight.data = transposed.T
        self.weight_t = transposed.numpy()
        self.bias = bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(
            transposed.T.contiguous(), None) if small_rows else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and 1 < x.shape[0] <= self.SMALL_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias,
                                                      "none", [], "")
        out = torch.from_numpy(np.matmul(x.contiguous().numpy(), self.weight_t))
        return out if self.bias is None else out.add_(self.bias)


class OneDnnLinear:
    """A CPU bf16 linear through oneDNN's bf16 GEMM (AMX or AVX512-BF16 where the CPU has
    them, chosen by oneDNN at run time) on a weight re-laid once, at load, in the blocked
    layout oneDNN wants: a plain bf16 `F.linear` re-lays it on every call (1.3-2.2x slower
    per call at 1-32 rows on a Xeon with AMX, docs/benchmarks.md). Same results as
    `F.linear`, bit for bit.

    Where the CPU kernels have a few-row bf16 GEMM (vdpbf16ps on AVX512-BF16, AMX tiles
    where present), the row counts it is the faster for (decode steps: `gemv_rows()`) go to
    it instead, on a third copy of the weight laid out for it: it streams the weight once
    per step at close to the machine's read bandwidth, where oneDNN's GEMM reached about
    55 % of it at few rows (docs/benchmarks.md). Its sums are fp32 as oneDNN's, perhaps
    in another order: results can differ from `F.linear` in the last bf16 bit.

    Args:
        weight: a CPU bfloat16 `[out, in]` weight; it is kept as it is (the packed copies
            are more, opaque to torch).
        bias: optional `[out]`.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = bias
        self.kernels = cpu_kernels()
        out_features, in_features = weight.shape
        self.gemv_rows = self.kernels.gemv_rows() if self.kernels is not None else 0
        self.gemv_packed = self.kernels.pack_gemv(weight.detach()) \
            if self.gemv_rows and out_features % 16 == 0 and in_features % 2 == 0 else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv_packed is not None and x.shape[0] <= self.gemv_rows:
            return self.kernels.gemv(x.contiguous(), self.gemv_packed, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias,
                                                  "none", [], "")


def _is_cpu_fp32(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.float32


def _is_cpu_bf16(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.bfloat16


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same operation order as Hugging Face, so fp32 results agree bit for bit.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class DecoderLayer(nn.Module):
    """Attention (fused q/k/v; per-head q/k norms where `cfg.qk_norm`) and an MLP: dense
    SwiGLU (`gate_up_proj`, `down_proj`), or `mlp`, a sparse MoE block, where `layer_id` is
    one of `cfg.moe_layers` (the dense projections are then None).

    Under tensor parallelism `cfg` has one rank's heads and intermediate sizes
    (`engine.parallel.shard_config`), and the outputs of `o_proj` and of the MLP (each a
    partial sum over this rank's columns) are all-reduced over `group`.

    Args:
        cfg: architecture (one rank's shapes under tensor parallelism).
        layer_id: the layer's index.
        group: the tensor-parallel group; None: the whole layer is here.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int,
                 group: ParallelGroup | None = None) -> None:
        super().__init__()
        self.group = group
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.head_dim = cfg.head_dim
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.attention_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoeBlock(cfg) if layer_id in cfg.moe_layers else None
        dense = self.mlp is None
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size,
                                      bias=False) if dense else None
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size,
                                   bias=False) if dense else None
        self.kernels: ModuleType | None = None  # set by `prepare_matmuls` on CPU fp32/bf16

    def linears(self) -> list[nn.Linear]:
        """The layer's matmuls: attention's, then the dense MLP's or the MoE block's."""
        mlp = self.mlp.linears() if self.mlp is not None else [self.gate_up_proj,
                                                               self.down_proj]
        return [self.qkv_proj, self.o_proj, *mlp]

    def params_per_token(self) -> int:
        """Matmul parameters one token goes through: every one of a dense layer; of an MoE
        layer, the router's and `top_k` experts'."""
        def count(linears: list[nn.Linear]) -> int:
            return sum(p.numel() for linear in linears for p in linear.parameters())
        if self.mlp is None:
            return count(self.linears())
        expert = self.mlp.experts[0]
        return count([self.qkv_proj, self.o_proj, self.mlp.gate]) + self.mlp.top_k * count(
            [expert.gate_up_proj, expert.down_proj])

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                attn: AttentionBackend, kv_layer: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self._fused_forward(x, rope, attn, kv_layer)
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(self.input_layernorm(x)).split(
            [self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, -1, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, -1, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, k, *rope)
        attn_out = attn.forward(q, k, v, kv_layer)
        x = x + self._reduce(self.o_proj(attn_out.reshape(num_tokens, self.q_size)))
        return x + self._reduce(self._mlp(self.post_attention_layernorm(x)))

    def _fused_forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                       attn: AttentionBackend, kv_layer: torch.Tensor) -> torch.Tensor:
        """`forward` with the glue between the matmuls in one kernel call each (CPU fp32 and
        bf16, rounding where Hugging Face's bf16 modules round):
        norm, RoPE in place, residual add + norm, SiLU * up. `x` is updated in place."""
        k = self.kernels
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(k.rms_norm(x, self.input_layernorm.weight,
                                       self.input_layernorm.eps))
        if self.q_norm is not None:
            self._norm_qk_heads_(qkv)
        cos, sin = rope
        k.rope_(qkv, cos.view(num_tokens, -1), sin.view(num_tokens, -1),
                (self.q_size + self.kv_size) // self.head_dim, self.head_dim)
        q, key, v = (t.view(num_tokens, -1, self.head_dim) for t in qkv.split(
            [self.q_size, self.kv_size, self.kv_size], dim=-1))
        attn_out = attn.forward(q, key, v, kv_layer)
        attn_out = self._reduce(self.o_proj(attn_out.reshape(num_tokens, self.q_size)))
        h = k.add_rms_norm(x, attn_out, self.post_attention_layernorm.weight,
                           self.post_attention_layernorm.eps)
        return x.add_(self._reduce(self._mlp(h)))

    def _norm_qk_heads_(self, qkv: torch.Tensor) -> None:
        """q_norm and k_norm over each query and key head of `qkv` `[T, (Hq + 2 Hkv) * D]`,
        in place (before RoPE, as Qwen3 does)."""
        num_q = self.q_size // self.head_dim
        heads = qkv[:, :self.q_size + self.kv_size].unflatten(1, (-1, self.head_dim))
        heads[:, :num_q] = self.q_norm(heads[:, :num_q])  # [T, Hq, D]
        heads[:, num_q:] = self.k_norm(heads[:, num_q:])  # [T, Hkv, D]

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel matmul's output: this rank's partial sum, summed over the ranks
        (an MoE block's once for all its experts)."""
        return partial if self.group is None else self.group.all_reduce(partial)

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        if self.mlp is not None:
            return self.mlp(h, self.kernels)
        return self.down_proj(silu_mul(self.gate_up_proj(h), self.kernels))


class LlamaForCausalLM(nn.Module):
    """Decoder-only transformer of any family in this module; `forward` takes a flattened
    batch of new tokens.

    With a tensor-parallel `group` it is one rank's shard (`engine.parallel`): its share
    of every layer, and its rows of the vocabulary in the embedding and LM head.

    Args:
        cfg: architecture (the whole model's).
        rope: rotary tables.
        group: the tensor-parallel group; None: the whole model is here.
    """

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding,
                 group: ParallelGroup | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.rope = rope
        self.group = group
        size = 1 if group is None else group.size
        vocab = vocab_shard_rows(cfg.vocab_size, size)
        # An uninitialised table (the weights are loaded over it): Embedding's own random
        # init on the meta device would import torch's compiler, a second of every start.
        self.embed_tokens = nn.Embedding(vocab, cfg.hidden_size,
                                         _weight=torch.empty(vocab, cfg.hidden_size))
        layer_cfg = shard_config(cfg, size)
        self.layers = nn.ModuleList(DecoderLayer(layer_cfg, i, group)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(
            cfg.hidden_size, vocab, bias=False)
        self._tied_head: BlasLinear | OneDnnLinear | None = None

    def prepare_matmuls(self) -> None:
        """Once the weights are loaded: CPU fp32 linears go through `BlasLinear`, CPU bf16
        ones through `OneDnnLinear` where oneDNN has a bf16 path on this CPU (else torch's
        own kernels), and the layers' glue through the fused CPU kernels (where they
        could be built). `engine.hardware.cpu_paths` decides."""
        linears = [proj for layer in self.layers for proj in layer.linears()]
        paths = cpu_paths()
        small_rows = paths.fp32_small_rows
        onednn_bf16 = paths.bf16_onednn
        for linear in linears + ([self.lm_head] if self.lm_head is not None else []):
            if _is_cpu_fp32(linear.weight):
                linear.forward = BlasLinear(linear.weight, linear.bias, small_rows)
            elif _is_cpu_bf16(linear.weight) and onednn_bf16:
                linear.forward = OneDnnLinear(linear.weight, linear.bias)
        embedding = self.embed_tokens.weight
        if _is_cpu_fp32(embedding) or _is_cpu_bf16(embedding):
            kernels = cpu_kernels()
            for layer in self.layers:
                layer.kernels = kernels
        if self.lm_head is None and _is_cpu_fp32(embedding):
            # A tied LM head shares the embedding's storage: gathering embedding rows from
            # the transposed layout costs microseconds (the prepacked copy for small row
            # counts, where kept, is a second one: 113 MB for SmolLM2).
            self._tied_head = BlasLinear(embedding, small_rows=small_rows)
        elif self.lm_head is None and _is_cpu_bf16(embedding) and onednn_bf16:
            # oneDNN's packed copy, and the few-row GEMM's where the kernels have it (57 MB
            # each for SmolLM2).
            self._tied_head = OneDnnLinear(embedding)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                attn: AttentionBackend, layer_hook: LayerHook | None = None,
                num_layers: int | None = None) -> torch.Tensor:
        """Hidden states `[T, hidden]` of the new tokens; their KV lands in `kv_cache`.

        `layer_hook(i)` runs once layer i has written its KV, so a transfer of that layer
        can overlap the compute of the next ones. `num_layers` stops after the first layers
        (an early-exit draft).
        """
        x = self.embed_tokens(input_ids) if self.group is None else \
            vocab_parallel_embedding(input_ids, self.embed_tokens.weight, self.group)
        rope = self.rope.lookup(positions, x.dtype)
        for i, layer in enumerate(self.layers[:num_layers]):
            x = layer(x, rope, attn, kv_cache.layers[i])
            if layer_hook is not None:
                layer_hook(i)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits `[N, vocab]` for the chosen hidden states `[N, hidden]` (on a tensor-
        parallel follower: its shard's columns, which only rank 0 gathers)."""
        hidden = self.norm(hidden)
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        elif self._tied_head is not None:
            logits = self._tied_head(hidden)
        else:
            logits = F.linear(hidden, self.embed_tokens.weight)
        if self.group is None:
            return logits
        return gather_logits(logits, self.group, self.cfg.vocab_size)
