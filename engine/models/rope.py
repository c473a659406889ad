"""Rotary position embeddings, including the scaled variants Hugging Face configs declare."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def _rope_parameters(hf_config: PretrainedConfig) -> dict:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling",
                                                                    None) or {}
    params = dict(params)
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by position.

    Args:
        hf_config: the model's Hugging Face config (rope theta and scaling live there).
        head_dim: size of one attention head.
        max_positions: table length.
        device: where the tables live.
    """

    def __init__(self, hf_config: PretrainedConfig, head_dim: int, max_positions: int,
                 device: torch.device) -> None:
        params = _rope_parameters(hf_config)
        rope_type = params["rope_type"]
        scaling = 1.0
        if rope_type == "default":
            exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
            inv_freq = 1.0 / (params["rope_theta"] ** exponent)
        elif rope_type in ROPE_INIT_FUNCTIONS:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
        else:
            raise ValueError(f"rope_type {rope_type!r} is not supported")
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.float())  # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.cos = (emb.cos() * scaling).to(device)
        self.sin = (emb.sin() * scaling).to(device)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[T, 1, D]` for token positions `[T]` (once per step, shared by layers)."""
        return (self.cos[positions].unsqueeze(1).to(dtype),
                self.sin[positions].unsqueeze(1).to(dtype))


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate `q` `[T, Hq, D]` and `k` `[T, Hkv, D]` by `RotaryEmbedding.lookup` tables."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
