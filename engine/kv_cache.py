"""The paged KV cache tensors: one tensor per layer in FlashInfer's NHD layout (int8 pages
carry each row's scale after it: `engine/kv_quant.py`), and shared memory to hold them."""

from __future__ import annotations

import copy
import os
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

    def heads(self, heads: range) -> KVCache:
        """The pages of KV heads `heads` only: views of this pool's memory (a tensor-parallel
        rank's share of a pool whose every head one place can read and write). Each layer
        is `[num_blocks, 2, block_size, len(heads), D]`, strided: a block's rows are no
        longer contiguous, so only the attention reads and writes through it."""
        view = copy.copy(self)
        view.num_kv_heads = len(heads)
        view.buffer = self.buffer[..., heads.start:heads.stop, :]
        view.layers = list(view.buffer.unbind(0))
        return view

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


class SharedPages:
    """`KVCache` allocator placing the pool in an anonymous memfd that other processes of
    this host map (`map_shared`): a KV transport's peer, a tensor-parallel rank.

    The segment has no name in any filesystem (`memfd_create`), so it cannot outlive its
    users: the kernel frees it when the last descriptor and mapping are gone. The owner's go
    when it exits, even on SIGKILL. Use one per pool: `KVCache(..., allocator=pages)`.

    Args:
        name: label shown in `/proc/<pid>/maps` (debugging only; no file is created).
    """

    def __init__(self, name: str = "pdcluster-kv") -> None:
        self.name = name
        self.fd: int | None = None
        self.nbytes = 0

    def __call__(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Allocate the flat, zeroed pool of `numel` elements of `dtype`, a CPU tensor
        backed by the shared segment."""
        if self.nbytes:
            raise RuntimeError("shared pages back exactly one KV cache")
        self.nbytes = numel * torch.empty((), dtype=dtype).element_size()
        self.fd = os.memfd_create(self.name, os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.nbytes)  # a fresh memfd reads as zeros
        return torch.from_file(f"/proc/self/fd/{self.fd}", shared=True, size=numel, dtype=dtype)

    def close(self) -> None:
        """Close the descriptor: no process can map the pool any more, and its memory goes
        as soon as the KV cache tensor and every other mapping are gone. Exit does the same."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def map_shared(pid: int, fd: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """Map another process's `SharedPages` through `/proc/<pid>/fd/<fd>`: writes land in its
    memory; the mapping goes when the tensor does.

    Returns:
        The flat pool, `nbytes` of `dtype`.

    Raises:
        OSError: the owner is gone or in another PID namespace.
        ValueError: `nbytes` is not a whole number of elements.
    """
    size = torch.empty((), dtype=dtype).element_size()
    if nbytes % size:
        raise ValueError(f"a shared pool of {nbytes} bytes is not a whole number of {dtype}")
    return torch.from_file(f"/proc/{pid}/fd/{fd}", shared=True, size=nbytes // size,
                           dtype=dtype)
