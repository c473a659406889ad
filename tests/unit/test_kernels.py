"""The fused CPU layer kernels against the torch ops they replace (the model's own
reference path), on odd row counts and strided views like the ones a step passes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import cpu_kernels
from engine.models.llama import RMSNorm
from engine.models.rope import apply_rope

GEN = torch.Generator().manual_seed(3)


@pytest.fixture(scope="module")
def kernels():
    module = cpu_kernels()
    assert module is not None, "the CPU kernels must build (make install checks a compiler)"
    return module


def _rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN)


@pytest.mark.parametrize("rows", [1, 7, 33])
def test_rms_norm_and_residual_add(kernels, rows):
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = _rand(576)
    x, delta = _rand(rows, 576), _rand(rows, 576)
    torch.testing.assert_close(kernels.rms_norm(x, norm.weight, norm.eps), norm(x),
                               atol=2e-6, rtol=1e-5)
    residual = x.clone()
    out = kernels.add_rms_norm(residual, delta, norm.weight, norm.eps)
    torch.testing.assert_close(residual, x + delta)  # updated in place
    torch.testing.assert_close(out, norm(x + delta), atol=2e-6, rtol=1e-5)


def test_rope_in_place_on_the_query_and_key_heads_only(kernels):
    heads, kv_heads, dim, rows = 9, 3, 64, 5
    qkv = _rand(rows, (heads + 2 * kv_heads) * dim)
    angles = _rand(rows, dim // 2)
    cos, sin = (torch.cat([f(angles)] * 2, -1) for f in (torch.cos, torch.sin))
    q, k, v = (t.view(rows, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim,
                                                         kv_heads * dim], -1))
    want_q, want_k = apply_rope(q, k, cos[:, None], sin[:, None])
    want_v = v.clone()
    kernels.rope_(qkv, cos, sin, heads + kv_heads, dim)
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k, want_k)
    assert torch.equal(v, want_v)


def test_silu_mul(kernels):
    gate_up = _rand(6, 2 * 1536)
    gate, up = gate_up.chunk(2, -1)
    torch.testing.assert_close(kernels.silu_mul(gate_up), F.silu(gate) * up)


def test_bad_input_is_refused(kernels):
    with pytest.raises(RuntimeError, match="CPU float32"):
        kernels.rms_norm(_rand(2, 8).double(), _rand(8), 1e-5)
    with pytest.raises(RuntimeError, match="rows contiguous"):
        kernels.silu_mul(_rand(8, 4).T)
