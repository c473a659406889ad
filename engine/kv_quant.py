"""The int8 KV cache format (`--kv-cache-dtype int8`): symmetric int8 with one fp32 scale
per token and KV head, stored in the page right after the row it scales.

A page row of one token and one KV head is `head_dim` int8 values followed by 4 bytes, the
fp32 scale `max|x| / 127` of that row: `[num_blocks, 2, block_size, num_kv_heads,
head_dim + 4]` int8. Per token and head rather than per block because tokens are appended
one step at a time: a block scale would have to grow (and every earlier entry be
requantized) whenever a new token exceeded it, while a row's scale is fixed when the row
is written. fp32 rather than bf16 for the scale: 4 bytes against head_dim (64 for SmolLM2),
and it is exact, so the error is the int8 rounding alone. Keeping the scale inside the row
keeps a block of one layer one contiguous slice: the KV transfer ships int8 pages and their
scales without knowing the format.
"""

from __future__ import annotations

from typing import Literal

import torch

KVCacheDtype = Literal["auto", "int8"]
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "int8")
SCALE_BYTES = 4  # one fp32 scale after each row
_LEVELS = 127.0  # symmetric: -127..127, so -x quantizes to -q


def check_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """Validate a `--kv-cache-dtype` value.

    Raises:
        ValueError: not `auto` or `int8` (`fp8_e4m3` is named as FlashInfer-only).
    """
    if kv_cache_dtype in KV_CACHE_DTYPES:
        return kv_cache_dtype
    hint = " (fp8 KV needs the FlashInfer CUDA backend, which pdcluster does not wire up " \
        "yet)" if kv_cache_dtype.startswith("fp8") else ""
    raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                     f"got {kv_cache_dtype!r}{hint}")


def row_width(head_dim: int, kv_cache_dtype: str) -> int:
    """Elements of one page row: `head_dim`, plus the scale's bytes for int8."""
    return head_dim + SCALE_BYTES if kv_cache_dtype == "int8" else head_dim


def quantize(x: torch.Tensor) -> torch.Tensor:
    """Rows of `x` as int8 values followed by their fp32 scale.

    Args:
        x: `[..., head_dim]`, any float dtype; head_dim a multiple of 4.

    Returns:
        int8 `[..., head_dim + 4]`.
    """
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / _LEVELS  # [..., 1]
    # tiny keeps an all-zero row (padding, zero activations) at zero instead of NaN
    values = (x / scale.clamp_min(torch.finfo(torch.float32).tiny)).round_().clamp_(
        -_LEVELS, _LEVELS)
    out = torch.empty(*x.shape[:-1], x.shape[-1] + SCALE_BYTES, dtype=torch.int8,
                      device=x.device)
    out[..., :-SCALE_BYTES] = values
    out[..., -SCALE_BYTES:] = scale.view(torch.int8)
    return out


def dequantize(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values of packed int8 rows (`quantize`'s output, or gathered pages of it).

    Args:
        packed: int8 `[..., head_dim + 4]`; head_dim a multiple of 4.
        dtype: the result's dtype.

    Returns:
        `[..., head_dim]` of `dtype`.
    """
    scale = packed[..., -SCALE_BYTES:].view(torch.float32)  # [..., 1], no copy
    return (packed[..., :-SCALE_BYTES].float() * scale).to(dtype)
