"""Picks the attention backend for a device: the one module that knows every backend."""

from __future__ import annotations

import importlib.util

import torch

from engine.attention.base import AttentionBackend
from engine.attention.flashinfer_backend import FlashInferBackend
from engine.attention.torch_backend import TorchAttentionBackend


def get_backend(device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int,
                name: str = "auto") -> AttentionBackend:
    """FlashInfer on CUDA when installed, torch otherwise (or as asked by `name`).

    Args:
        device: where the KV pages live.
        num_heads: query heads.
        num_kv_heads: key/value heads.
        head_dim: channels per head.
        name: `auto`, `torch` or `flashinfer`.

    Returns:
        A fresh backend.

    Raises:
        ValueError: an unknown `name`.
    """
    if name == "auto":
        has_flashinfer = importlib.util.find_spec("flashinfer") is not None
        name = "flashinfer" if device.type == "cuda" and has_flashinfer else "torch"
    if name == "torch":
        return TorchAttentionBackend(num_heads, num_kv_heads, head_dim)
    if name == "flashinfer":
        return FlashInferBackend(num_heads, num_kv_heads, head_dim, device)
    raise ValueError(f"attention backend must be auto, torch or flashinfer, got {name!r}")
