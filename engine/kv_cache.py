"""The paged KV cache tensors: one tensor per layer in FlashInfer's NHD layout (int8 pages
carry each row's scale after it: `engine/kv_quant.py`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.kv_quant import check_kv_cache_dtype, row_width

# Allocates a flat, zeroed buffer of `numel` elements; lets a transport place the pool in
# shared memory (CPU) without the engine knowing how.
BufferAllocator = Callable[[int, torch.dtype], torch.Tensor]


class KVCache:
    """Per-layer KV pages, `[num_blocks, 2, block_size, num_kv_heads, head_dim]` each, or
    int8 `[..., head_dim + 4]` (values, then the row's fp32 scale) with `kv_cache_dtype`
    int8.

    All layers are views of one contiguous buffer `[num_layers, num_blocks, 2, block_size,
    num_kv_heads, head_dim]`, so one block of one layer (`layers[l][b]`) is a contiguous
    slice: a transfer is a list of slices.

    Args:
        num_layers: transformer layers.
        num_blocks: pages per layer.
        block_size: tokens per page.
        num_kv_heads: key/value heads.
        head_dim: size of one head.
        dtype: the model's dtype, the pages' element type with `kv_cache_dtype` auto.
        device: where the pages live.
        allocator: optional function returning the flat buffer (for example shared memory).
        kv_cache_dtype: `auto` (the model's dtype) or `int8`.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 allocator: BufferAllocator | None = None, kv_cache_dtype: str = "auto") -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.quantized = check_kv_cache_dtype(kv_cache_dtype) == "int8"
        self.dtype = torch.int8 if self.quantized else dtype  # of the pages' elements
        dtype = self.dtype
        shape = (num_layers, num_blocks, 2, block_size, num_kv_heads,
                 row_width(head_dim, kv_cache_dtype))
        numel = 1
        for dim in shape:
            numel *= dim
        if allocator is None:
            flat = torch.zeros(numel, dtype=dtype, device=device)
        else:
            flat = allocator(numel, dtype)
            if flat.numel() != numel or flat.dtype != dtype:
                raise ValueError(
                    f"KV allocator returned {flat.numel()} x {flat.dtype}, need {numel} x {dtype}")
        self.buffer = flat.view(shape)  # [L, N, 2, bs, H, D (+ 4 for int8)]
        self.layers: list[torch.Tensor] = list(self.buffer.unbind(0))

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer (K and V, int8 scales included)."""
        return self.buffer[0, 0].nbytes

    @property
    def kv_cache_dtype(self) -> str:
        """What the pages hold: `int8`, or the model's dtype (`float32`, `bfloat16`, ...)."""
        return str(self.dtype).removeprefix("torch.")

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
        """Bytes one block costs across all layers (int8 scales included)."""
        elem = 1 if kv_cache_dtype == "int8" else torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * \
            row_width(head_dim, kv_cache_dtype) * elem

    def layout(self) -> dict[str, object]:
        """A description of the pool for compatibility checks between engines."""
        return {
            "layout": "NHD",
            "num_layers": self.num_layers,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.kv_cache_dtype,
        }
