"""Small CPU fp32 batches go through numpy's BLAS on a transposed copy: same results as torch."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.models.llama import SMALL_BATCH_ROWS, SmallBatchWeight, small_batch_linear


@pytest.mark.parametrize("rows", [1, 3, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1, 64])
def test_small_batch_weight_matches_torch_linear(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(48, 32, generator=gen)
    x = torch.randn(32, rows, generator=gen).T  # not contiguous: the path must cope
    out = SmallBatchWeight(weight)(x)
    assert out.shape == (rows, 48) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_only_bias_free_cpu_fp32_linears_are_rerouted():
    plain = nn.Linear(8, 4, bias=False)
    biased = nn.Linear(8, 4)
    bf16 = nn.Linear(8, 4, bias=False).to(torch.bfloat16)
    for module in (plain, biased, bf16):
        small_batch_linear(module)
    assert isinstance(plain.forward, SmallBatchWeight)
    assert not isinstance(biased.forward, SmallBatchWeight)
    assert not isinstance(bf16.forward, SmallBatchWeight)
    x = torch.randn(2, 8)
    torch.testing.assert_close(plain(x), F.linear(x, plain.weight), rtol=1e-5, atol=1e-5)
