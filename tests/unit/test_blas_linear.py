"""CPU fp32 linears run through numpy's BLAS on one transposed weight layout (and oneDNN's
prepacked GEMM from two rows on AVX-512 CPUs): same results as `F.linear`."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import LLM
from engine.hardware import cpu_features
from engine.models.llama import BlasLinear, OneDnnLinear


@pytest.mark.parametrize("rows", [1, 3, 17, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("prepacked", [False, True])
def test_blas_linear_matches_torch_linear(rows, bias, prepacked):
    gen = torch.Generator().manual_seed(rows)
    module = nn.Linear(32, 48, bias=bias)
    reference = module.weight.detach().clone()
    x = torch.randn(32, rows, generator=gen).T  # not contiguous: the path must cope
    module.forward = BlasLinear(module.weight, module.bias, prepacked)
    assert (module.forward.packed is not None) == prepacked
    out = module(x)
    assert out.shape == (rows, 48) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, reference, module.bias), rtol=1e-5, atol=1e-5)


def test_one_weight_layout_is_kept():
    # The parameter keeps its shape and values but is a view of the transposed storage that
    # the BLAS call reads: no second copy of any weight, the tied embedding included.
    model = LLM("tiny").engine.model
    qkv = model.layers[0].qkv_proj
    assert isinstance(qkv.forward, BlasLinear)
    assert qkv.weight.T.is_contiguous()
    assert qkv.weight.data_ptr() == qkv.forward.weight_t.ctypes.data
    assert model.lm_head is None  # tiny ties its LM head to the embedding
    assert model._tied_head.weight_t.ctypes.data == model.embed_tokens.weight.data_ptr()


def test_fp32_prepacked_copies_follow_the_cpu():
    # Kept exactly where the CPU has AVX-512 (oneDNN beats OpenBLAS from two rows there),
    # for every layer linear and the tied head; the step's logged paths name the choice.
    engine = LLM("tiny").engine
    model = engine.model
    heads = [model._tied_head] + [p.forward for layer in model.layers for p in (
        layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]
    assert {h.packed is not None for h in heads} == {cpu_features().avx512}
    assert ("oneDNN fp32 prepacked" in engine.runner.hardware) == cpu_features().avx512


def test_bf16_linears_run_on_prepacked_onednn_weights_with_f_linear_results():
    model = LLM("tiny", dtype="bfloat16").engine.model
    qkv = model.layers[0].qkv_proj
    assert isinstance(qkv.forward, OneDnnLinear) and isinstance(model._tied_head, OneDnnLinear)
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 5, 70):
        x = torch.randn(rows, qkv.in_features, generator=gen).bfloat16()
        assert torch.equal(qkv(x), F.linear(x, qkv.weight, qkv.bias))
    hidden = torch.randn(3, model.cfg.hidden_size, generator=gen).bfloat16()
    assert torch.equal(model.compute_logits(hidden),
                       F.linear(model.norm(hidden), model.embed_tokens.weight))


def test_fp16_keeps_torch_linear():
    model = LLM("tiny", dtype="float16").engine.model
    assert "forward" not in vars(model.layers[0].qkv_proj)  # nn.Linear's own
