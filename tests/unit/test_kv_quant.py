"""The int8 KV format: round trip within half a quantization step, sizes and bad input."""

import pytest
import torch

from engine.config import CacheConfig
from engine.kv_cache import KVCache
from engine.kv_quant import SCALE_BYTES, dequantize, quantize


def test_round_trip_error_is_at_most_half_a_step_per_row():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=gen) * torch.logspace(-3, 2, 50)[:, None, None]
    x[7, 1] = 0.0  # an all-zero row stays zero (no NaN from a zero scale)
    packed = quantize(x)
    assert packed.dtype == torch.int8 and packed.shape == (50, 3, 64 + SCALE_BYTES)
    back = dequantize(packed, torch.float32)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert torch.all((back - x).abs() <= step / 2 * (1 + 1e-5) + 1e-12)
    assert torch.equal(back[7, 1], torch.zeros(64))
    # the row's largest magnitude is exact up to fp32 rounding (it maps to +-127)
    top = x.abs().argmax(-1, keepdim=True)
    torch.testing.assert_close(back.gather(-1, top), x.gather(-1, top))
    # bf16 input and output
    assert dequantize(quantize(x.bfloat16()), torch.bfloat16).dtype == torch.bfloat16


def test_int8_blocks_at_a_fixed_budget():
    # SmolLM2-135M: 30 layers, 3 KV heads of 64; 16-token blocks.
    args = (30, 16, 3, 64)
    fp32 = KVCache.bytes_per_block(*args, torch.float32)
    bf16 = KVCache.bytes_per_block(*args, torch.bfloat16)
    int8 = KVCache.bytes_per_block(*args, torch.float32, "int8")
    assert int8 == 30 * 2 * 16 * 3 * (64 + 4)  # values and one fp32 scale per row
    assert (fp32 / int8, bf16 / int8) == pytest.approx((256 / 68, 128 / 68))  # 3.76x, 1.88x
    cache = KVCache(2, 5, 16, 3, 64, torch.bfloat16, kv_cache_dtype="int8")
    assert cache.dtype == torch.int8 and cache.kv_cache_dtype == "int8"
    assert cache.layers[0].shape == (5, 2, 16, 3, 68) and cache.layers[1][4].is_contiguous()
    assert cache.block_bytes == 2 * 16 * 3 * 68 and cache.layout()["dtype"] == "int8"


def test_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, int8, got 'int4'"):
        CacheConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="fp8 KV needs the FlashInfer CUDA backend"):
        KVCache(1, 1, 16, 1, 64, torch.float32, kv_cache_dtype="fp8_e4m3")
