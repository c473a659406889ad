"""CPU fp32 linears run through numpy's BLAS on one transposed weight layout (and oneDNN's
prepacked GEMM for small row counts on AVX-512 CPUs): `F.linear`'s results."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import LLM, CacheConfig
from engine.hardware import cpu_paths
from engine.kernels import cpu_kernels
from engine.models.llama import BlasLinear, OneDnnLinear
from tests.conftest import cpu_lacks

SMALL_POOL = CacheConfig(num_blocks=16)  # not the default 1 GiB: only the weights matter here


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("small_rows", [False, True])
def test_blas_linear_matches_torch_linear(rows, bias, small_rows):
    gen = torch.Generator().manual_seed(rows)
    module = nn.Linear(32, 48, bias=bias)
    reference = module.weight.detach().clone()
    x = torch.randn(32, rows, generator=gen).T  # not contiguous: the path must cope
    module.forward = BlasLinear(module.weight, module.bias, small_rows)
    out = module(x)
    assert out.shape == (rows, 48) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, reference, module.bias), rtol=1e-5, atol=1e-5)


def test_one_weight_layout_is_kept():
    # The parameter keeps its shape and values but is a view of the transposed storage that
    # the BLAS call reads: no second copy of any weight, the tied embedding included.
    model = LLM("tiny", cache=SMALL_POOL).engine.model
    qkv = model.layers[0].qkv_proj
    assert isinstance(qkv.forward, BlasLinear)
    assert qkv.weight.T.is_contiguous()
    assert qkv.weight.data_ptr() == qkv.forward.weight_t.ctypes.data
    assert model.lm_head is None  # tiny ties its LM head to the embedding
    assert model._tied_head.weight_t.ctypes.data == model.embed_tokens.weight.data_ptr()


def test_small_row_counts_take_onednn_where_the_cpu_has_avx512(monkeypatch):
    # Every fp32 linear, the tied head included, exactly on AVX-512 CPUs; the step's logged
    # paths name the choice. Which kernel ran is seen by breaking numpy's matmul: 2-16 rows
    # must not need it, 1 and 17 must.
    wanted = cpu_paths().fp32_small_rows
    engine = LLM("tiny", cache=SMALL_POOL).engine
    model = engine.model
    linears = [model._tied_head] + [p.forward for layer in model.layers for p in (
        layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]
    assert {f.packed is not None for f in linears} == {wanted}
    assert ("oneDNN fp32 prepacked at 2-16 rows" in engine.runner.hardware) == wanted
    qkv = model.layers[0].qkv_proj

    def broken(*_args, **_kwargs):
        raise RuntimeError("numpy matmul")
    monkeypatch.setattr(np, "matmul", broken)
    for rows in (1, 2, 16, 17):
        x = torch.randn(rows, qkv.in_features)
        if wanted and rows in (2, 16):
            torch.testing.assert_close(qkv(x), F.linear(x, qkv.weight, qkv.bias),
                                       rtol=1e-5, atol=1e-5)
        else:
            with pytest.raises(RuntimeError, match="numpy matmul"):
                qkv(x)


def test_bf16_linears_run_on_prepacked_weights_with_f_linear_results():
    """Past the kernels' few-row GEMM (`gemv_rows`, 0 where the CPU has no vdpbf16ps):
    oneDNN, bit for bit `F.linear`; up to it, the kernel, within one bf16 rounding."""
    if not cpu_paths().bf16_onednn:
        pytest.skip(cpu_lacks("oneDNN's bf16 GEMM (AVX-512 BW/VL/DQ or AVX-NE-CONVERT, "
                              "uncapped): bf16 takes torch's linears (test_hardware.py)"))
    model = LLM("tiny", dtype="bfloat16", cache=SMALL_POOL).engine.model
    qkv = model.layers[0].qkv_proj
    assert isinstance(qkv.forward, OneDnnLinear) and isinstance(model._tied_head, OneDnnLinear)
    few = cpu_kernels().gemv_rows()
    assert (qkv.forward.gemv_packed is not None) == (few > 0)
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 5, few, few + 1, 70):
        x = torch.randn(max(rows, 1), qkv.in_features, generator=gen).bfloat16()
        expected = F.linear(x, qkv.weight, qkv.bias)
        if x.shape[0] <= few:
            torch.testing.assert_close(qkv(x), expected, atol=1e-5, rtol=1.6e-2)
        else:
            assert torch.equal(qkv(x), expected)
    hidden = torch.randn(3 if few < 3 else few + 1, model.cfg.hidden_size,
                         generator=gen).bfloat16()
    assert torch.equal(model.compute_logits(hidden),
                       F.linear(model.norm(hidden), model.embed_tokens.weight))


def test_fp16_keeps_torch_linear():
    model = LLM("tiny", dtype="float16", cache=SMALL_POOL).engine.model
    assert "forward" not in vars(model.layers[0].qkv_proj)  # nn.Linear's own
