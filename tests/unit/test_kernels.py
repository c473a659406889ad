"""The fused CPU layer kernels against the torch ops they replace (the model's own
reference path), on odd row counts and strided views like the ones a step passes: every
ISA variant, in float32 (to fp32 rounding) and bfloat16 (to bf16 rounding). A variant whose
ISA level the CPU lacks is a visible skip (`tests.conftest.cpu_lacks`), not left out."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.hardware import cpu_features, cpu_paths
from engine.kernels import ISA_TARGETS, cpu_kernels
from engine.models.llama import RMSNorm
from engine.models.rope import apply_rope
from tests.conftest import cpu_lacks

GEN = torch.Generator().manual_seed(3)


# fp32: the kernels' sums run in another order than torch's; bf16: one rounding step apart.
TOLERANCE = {torch.float32: {"atol": 2e-6, "rtol": 1e-5},
             torch.bfloat16: {"atol": 1e-5, "rtol": 1.6e-2}}


@pytest.fixture(scope="module")
def module():
    module = cpu_kernels()
    assert module is not None, "the CPU kernels must build (make install checks a compiler)"
    assert module.isas() == list(ISA_TARGETS)  # every variant is in the build
    return module


@pytest.fixture(params=list(ISA_TARGETS))
def kernels(module, request):
    """The module with one ISA variant selected (each variant; skipped where this CPU
    cannot run it)."""
    if request.param not in cpu_features().isa_levels:
        pytest.skip(cpu_lacks(request.param))
    chosen = module.isa()
    module.select_isa(request.param)
    assert module.isa() == request.param
    yield module
    module.select_isa(chosen)


def _rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN).to(dtype)


def test_the_best_variant_in_use_is_selected(module):
    paths = cpu_paths()
    assert module.isa() == paths.level
    if paths.cap is None and cpu_features().amx:
        assert paths.level == "amx"
    elif paths.cap is None and cpu_features().native_bf16 and cpu_features().avx512:
        assert paths.level == "avx512_bf16"
    with pytest.raises(RuntimeError, match="no kernel variant named sse9"):
        module.select_isa("sse9")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_rms_norm_and_residual_add(kernels, rows, dtype):
    norm = RMSNorm(576, 1e-5).to(dtype)
    norm.weight.data = _rand(576, dtype=dtype)
    x, delta = _rand(rows, 576, dtype=dtype), _rand(rows, 576, dtype=dtype)
    torch.testing.assert_close(kernels.rms_norm(x, norm.weight, norm.eps), norm(x),
                               **TOLERANCE[dtype])
    residual = x.clone()
    out = kernels.add_rms_norm(residual, delta, norm.weight, norm.eps)
    assert torch.equal(residual, x + delta)  # updated in place, rounded as torch rounds
    torch.testing.assert_close(out, norm(x + delta), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_on_the_query_and_key_heads_only(kernels, dtype):
    heads, kv_heads, dim, rows = 9, 3, 64, 5
    qkv = _rand(rows, (heads + 2 * kv_heads) * dim, dtype=dtype)
    angles = _rand(rows, dim // 2)
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    q, k, v = (t.view(rows, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim,
                                                         kv_heads * dim], -1))
    want_q, want_k = apply_rope(q, k, cos[:, None], sin[:, None])
    want_v = v.clone()
    kernels.rope_(qkv, cos, sin, heads + kv_heads, dim)
    torch.testing.assert_close(q, want_q, **TOLERANCE[dtype])
    torch.testing.assert_close(k, want_k, **TOLERANCE[dtype])
    assert torch.equal(v, want_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(kernels, dtype):
    gate_up = _rand(6, 2 * 1536, dtype=dtype)
    gate, up = gate_up.chunk(2, -1)
    torch.testing.assert_close(kernels.silu_mul(gate_up), F.silu(gate) * up,
                               **TOLERANCE[dtype])


# (K, N): K a multiple of 32 (AMX's slices) or not, N in column blocks of 16 not a multiple
# of the kernels' 4 blocks at a time.
@pytest.mark.parametrize("k, n", [(64, 48), (96, 80), (34, 16)])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 17, 33])
@pytest.mark.parametrize("with_bias", [False, True])
def test_few_row_bf16_gemm_on_its_packed_weight(kernels, k, n, rows, with_bias):
    assert kernels.gemv_rows() == {"avx512_bf16": 4, "amx": 32}.get(kernels.isa(), 0)
    weight = _rand(n, k, dtype=torch.bfloat16)
    x = _rand(rows + 2, k, dtype=torch.bfloat16)[1:-1]  # a row-strided view
    bias = _rand(n, dtype=torch.bfloat16) if with_bias else None
    packed = kernels.pack_gemv(weight)
    if not kernels.gemv_rows():  # no vdpbf16ps in this variant: refused, not wrong
        with pytest.raises(RuntimeError, match="have no bf16 GEMV"):
            kernels.gemv(x, packed, bias)
        return
    reference = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    torch.testing.assert_close(kernels.gemv(x, packed, bias), reference.bfloat16(),
                               **TOLERANCE[torch.bfloat16])


def test_bad_input_is_refused(kernels):
    # The same answer from every variant: input is checked before the variant's kernel.
    with pytest.raises(RuntimeError, match="N must be a multiple of 16 and K even"):
        kernels.pack_gemv(_rand(20, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="packed a pack_gemv weight of K columns"):
        kernels.gemv(_rand(2, 8, dtype=torch.bfloat16),
                     kernels.pack_gemv(_rand(16, 10, dtype=torch.bfloat16)))
    if kernels.gemv_rows() == 0:  # a variant without a bf16 GEMV says so
        with pytest.raises(RuntimeError, match=f"the {kernels.isa()} kernels have no bf16 GEMV"):
            kernels.gemv(_rand(2, 16, dtype=torch.bfloat16),
                         kernels.pack_gemv(_rand(16, 16, dtype=torch.bfloat16)))
    with pytest.raises(RuntimeError, match="CPU float32 or bfloat16"):
        kernels.rms_norm(_rand(2, 8).double(), _rand(8), 1e-5)
    with pytest.raises(RuntimeError, match="rows contiguous"):
        kernels.silu_mul(_rand(8, 4).T)
    with pytest.raises(RuntimeError, match="weight must be of the input's dtype"):
        kernels.rms_norm(_rand(2, 8, dtype=torch.bfloat16), _rand(8), 1e-5)
