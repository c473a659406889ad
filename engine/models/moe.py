"""The sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks each token's top-k
SwiGLU experts, and each expert hit in a step runs once, on the rows routed to it.

All experts live on the model's one device (no expert parallelism).
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig


def silu_mul(gate_up: torch.Tensor, kernels: ModuleType | None = None) -> torch.Tensor:
    """SiLU(gate) * up of a fused gate/up projection `[T, 2I]` (gate first) -> `[T, I]`.

    Args:
        gate_up: the projection's output.
        kernels: the CPU kernels (`engine.kernels.cpu_kernels`), or None for torch's ops.
    """
    if kernels is not None:
        return kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class Expert(nn.Module):
    """One SwiGLU MLP, its gate and up projections fused into one matmul as a dense
    layer's are."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, kernels: ModuleType | None = None) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x), kernels))


class SparseMoeBlock(nn.Module):
    """Router `gate` (hidden -> experts, no bias) and `experts`, as transformers' Mixtral and
    Qwen3-MoE blocks compute them: a float32 softmax over all experts' logits, the top
    `num_experts_per_tok`, renormalised to sum 1 where `cfg.norm_topk_prob`, kept in float32
    where `cfg.moe_weights_fp32` (else rounded to the model's dtype), each expert's output
    scaled by its weight and summed into the token's row in ascending expert order.

    Args:
        cfg: the architecture (`num_experts`, `num_experts_per_tok`,
            `moe_intermediate_size`, `norm_topk_prob`, `moe_weights_fp32`).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.weights_fp32 = cfg.moe_weights_fp32
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(cfg.hidden_size, cfg.moe_intermediate_size)
                                     for _ in range(cfg.num_experts))

    def linears(self) -> list[nn.Linear]:
        """The router's and every expert's matmuls."""
        return [self.gate, *(p for e in self.experts for p in (e.gate_up_proj, e.down_proj))]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and their weights, both `[T, top_k]`, for hidden `x` `[T, H]`."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [T, E]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights if self.weights_fp32 else weights.to(x.dtype)

    def forward(self, x: torch.Tensor, kernels: ModuleType | None = None) -> torch.Tensor:
        """The block's output `[T, H]` for hidden `x` `[T, H]` (the tokens of every request
        in the step: an expert's matmul takes all rows routed to it at once)."""
        experts, weights = self.route(x)
        # The (token, expert) pairs grouped by expert: pair j of expert e's group is routed
        # token `rows[j]` with weight `pair_weights[j]`.
        flat = experts.flatten()  # [T * top_k]
        order = torch.argsort(flat, stable=True)
        rows = order // self.top_k
        pair_weights = weights.flatten()[order].unsqueeze(1)  # [T * top_k, 1]
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                routed = rows[start:start + count]
                y = expert(x.index_select(0, routed), kernels) * pair_weights[start:start + count]
                out.index_add_(0, routed, y.to(x.dtype))
            start += count
        return out
