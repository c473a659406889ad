"""Every attention backend against the same dense reference."""

import pytest
import torch

from engine.attention import BatchLayout, get_backend
from engine.hardware import cpu_features
from engine.kernels import ISA_TARGETS, cpu_kernels
from tests.conftest import CUDA_ONLY, cpu_lacks

HEADS, KV_HEADS, DIM, BS = 6, 2, 16, 4


def _dense(q, k, v, ctx_len):
    """Causal attention of the last q_len positions over ctx_len keys, with KV repeat."""
    q_len = q.shape[0]
    rep = HEADS // KV_HEADS
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / DIM**0.5
    pos_q = torch.arange(ctx_len - q_len, ctx_len)[:, None]
    scores = scores.masked_fill(torch.arange(ctx_len)[None, :] > pos_q, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _case(device):
    """A short and a long prompt over cached context (the short one attends through the
    decode kernel on CPU, `SHORT_QUERY`), a fresh prefill, and two decodes."""
    gen = torch.Generator().manual_seed(0)
    seqs = [(5, 13), (18, 27), (7, 7), (1, 10), (1, 3)]  # (query_len, context_len)
    tables = [[9, 2, 7, 4, 0, 0, 0], [10, 17, 11, 16, 12, 15, 13], [0, 5, 0, 0, 0, 0, 0],
              [3, 8, 1, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0, 0]]
    kv = torch.zeros(18, 2, BS, KV_HEADS, DIM)
    full_k, full_v, qs = [], [], []
    for (q_len, ctx), table in zip(seqs, tables, strict=True):
        k = torch.randn(ctx, KV_HEADS, DIM, generator=gen)
        v = torch.randn(ctx, KV_HEADS, DIM, generator=gen)
        for pos in range(ctx - q_len):  # the cached part is already in the pages
            kv[table[pos // BS], 0, pos % BS] = k[pos]
            kv[table[pos // BS], 1, pos % BS] = v[pos]
        full_k.append(k)
        full_v.append(v)
        qs.append(torch.randn(q_len, HEADS, DIM, generator=gen))
    slots = [table[p // BS] * BS + p % BS for (q_len, ctx), table in zip(seqs, tables,
                                                                          strict=True)
             for p in range(ctx - q_len, ctx)]
    layout = BatchLayout([s[0] for s in seqs], [s[1] for s in seqs],
                         torch.tensor(tables, device=device),
                         torch.tensor(slots, device=device), num_prefills=3, block_size=BS)
    new_k = torch.cat([k[ctx - q:] for k, (q, ctx) in zip(full_k, seqs, strict=True)])
    new_v = torch.cat([v[ctx - q:] for v, (q, ctx) in zip(full_v, seqs, strict=True)])
    expected = torch.cat([_dense(q, k, v, ctx) for q, k, v, (_, ctx)
                          in zip(qs, full_k, full_v, seqs, strict=True)])
    return layout, torch.cat(qs), new_k, new_v, kv, expected, full_k, tables, seqs, full_v


@pytest.mark.parametrize("name", [
    "torch",
    pytest.param("flashinfer", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason=f"{CUDA_ONLY}FlashInfer needs a GPU")),
])
def test_backend_matches_dense_reference(name):
    device = torch.device("cuda" if name == "flashinfer" else "cpu")
    layout, q, k, v, kv, expected, full_k, tables, seqs, _ = _case(device)
    backend = get_backend(device, HEADS, KV_HEADS, DIM, name)
    backend.begin_step(layout)
    if name == "torch":  # the 5 short-prompt tokens as decode queries, the rest by SDPA
        assert backend.short[0].tolist() == [0, 1, 2, 3, 4]
        assert backend.short[2].tolist() == [9, 10, 11, 12, 13]
        assert [(q_len, ctx) for _, q_len, ctx, *_ in backend.prefills] == [(18, 27), (7, 7)]
    kv = kv.to(device)
    out = backend.forward(q.to(device), k.to(device), v.to(device), kv)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)
    # The new keys landed in their pages.
    for key, table, (_, ctx) in zip(full_k, tables, seqs, strict=True):
        pages = kv[torch.tensor(table, device=device), 0].flatten(0, 1)[:ctx].cpu()
        torch.testing.assert_close(pages, key)


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="attention backend must be"):
        get_backend(torch.device("cpu"), HEADS, KV_HEADS, DIM, "magic")


@pytest.fixture(params=list(ISA_TARGETS))
def isa(request):
    """Each ISA variant of the kernels, selected for one test (skipped where this CPU
    cannot run it)."""
    if request.param not in cpu_features().isa_levels:
        pytest.skip(cpu_lacks(request.param))
    kernels = cpu_kernels()
    chosen = kernels.isa()
    kernels.select_isa(request.param)
    yield request.param
    kernels.select_isa(chosen)


# SmolLM2's head geometry, pages scattered over a 128-block pool, contexts around page edges.
SMOL_HEADS, SMOL_KV_HEADS, SMOL_DIM, SMOL_BS, SMOL_LENS = 9, 3, 64, 16, [1, 15, 16, 17, 300]


def _scattered_tables(gen: torch.Generator) -> torch.Tensor:
    max_blocks = -(-max(SMOL_LENS) // SMOL_BS)
    ids = torch.randperm(128, generator=gen)[:len(SMOL_LENS) * max_blocks]
    return ids.view(len(SMOL_LENS), -1)


def _assert_dense_attention(out, q, pages, tables, tol):
    """`out` against dense attention per sequence over `pages(table, j)`: the sequence's
    K (j = 0) or V (j = 1) as fp32 `[tokens, SMOL_KV_HEADS, SMOL_DIM]`."""
    for i, ctx in enumerate(SMOL_LENS):
        k, v = (pages(tables[i], j)[:ctx] for j in (0, 1))
        group = SMOL_HEADS // SMOL_KV_HEADS
        expected = torch.einsum("hk,khd->hd", torch.einsum(
            "hd,khd->hk", q[i].float(), k.repeat_interleave(group, 1)).div(SMOL_DIM**0.5)
            .softmax(-1), v.repeat_interleave(group, 1))
        torch.testing.assert_close(out[i].float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cpu_paged_decode_kernel_matches_dense_reference(isa, dtype, tol):
    from engine.attention.torch_backend import paged_decode

    gen = torch.Generator().manual_seed(1)
    tables = _scattered_tables(gen)
    kv = torch.randn(128, 2, SMOL_BS, SMOL_KV_HEADS, SMOL_DIM, generator=gen).to(dtype)
    q = torch.randn(len(SMOL_LENS), SMOL_HEADS, SMOL_DIM, generator=gen).to(dtype)
    out = paged_decode(q, kv, tables, torch.tensor(SMOL_LENS))
    _assert_dense_attention(out, q, lambda t, j: kv[t, j].flatten(0, 1).float(), tables, tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cpu_paged_decode_kernel_reads_int8_pages(isa, dtype, tol):
    # The same geometry over int8 pages: the reference attends over the dequantized rows,
    # so the kernel's only freedom is its summation order (and bf16 rounding of q/out).
    from engine.attention.torch_backend import paged_decode
    from engine.kv_quant import dequantize, quantize

    gen = torch.Generator().manual_seed(2)
    tables = _scattered_tables(gen)
    kv = quantize(torch.randn(128, 2, SMOL_BS, SMOL_KV_HEADS, SMOL_DIM, generator=gen) * 3)
    assert kv.dtype == torch.int8 and kv.shape[-1] == SMOL_DIM + 4
    q = torch.randn(len(SMOL_LENS), SMOL_HEADS, SMOL_DIM, generator=gen).to(dtype)
    out = paged_decode(q, kv, tables, torch.tensor(SMOL_LENS))
    _assert_dense_attention(
        out, q, lambda t, j: dequantize(kv[t, j].flatten(0, 1), torch.float32), tables, tol)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
def test_cpu_paged_decode_kernel_reads_one_ranks_heads_of_a_whole_pool(isa, kv_dtype):
    # A tensor-parallel rank's pages are its KV heads' slice of a pool holding every head
    # (here the second of three ranks' 3 heads of 9), read in place: the same output as the
    # slice copied out contiguous, and as dense attention over it.
    from engine.attention.torch_backend import paged_decode
    from engine.kv_quant import dequantize, quantize

    gen = torch.Generator().manual_seed(3)
    tables = _scattered_tables(gen)
    whole = torch.randn(128, 2, SMOL_BS, 3 * SMOL_KV_HEADS, SMOL_DIM, generator=gen)
    dtype = torch.float32 if kv_dtype == "int8" else getattr(torch, kv_dtype)
    whole = quantize(whole * 3) if kv_dtype == "int8" else whole.to(dtype)
    rank = whole[..., SMOL_KV_HEADS:2 * SMOL_KV_HEADS, :]
    assert not rank.is_contiguous()
    q = torch.randn(len(SMOL_LENS), SMOL_HEADS, SMOL_DIM, generator=gen).to(dtype)
    out = paged_decode(q, rank, tables, torch.tensor(SMOL_LENS))
    assert torch.equal(out, paged_decode(q, rank.contiguous(), tables, torch.tensor(SMOL_LENS)))
    rows = (lambda t, j: dequantize(rank[t, j].flatten(0, 1), torch.float32)) \
        if kv_dtype == "int8" else (lambda t, j: rank[t, j].flatten(0, 1).float())
    _assert_dense_attention(out, q, rows, tables, 1e-5 if dtype == torch.float32 else 2e-2)
    with pytest.raises(RuntimeError, match="contiguous pages, or a slice of their heads"):
        paged_decode(q, whole.transpose(2, 3), tables, torch.tensor(SMOL_LENS))


def test_int8_pages_prefill_and_decode_match_the_dense_reference_on_their_values():
    # Cached context, fresh prefill and decodes over int8 pages (kernel and per-sequence
    # paths): exact attention over the dequantized keys, near the full-precision answer.
    from engine.kv_quant import SCALE_BYTES, dequantize, quantize

    layout, q, k, v, kv, expected, full_k, tables, seqs, full_v = _case(torch.device("cpu"))
    pages = quantize(kv)
    backend = get_backend(torch.device("cpu"), HEADS, KV_HEADS, DIM, "torch")
    backend.begin_step(layout)
    kernel_out = backend.forward(q, k, v, pages)
    for key, table, (_, ctx) in zip(full_k, tables, seqs, strict=True):
        stored = pages[torch.tensor(table), 0].flatten(0, 1)[:ctx]
        assert stored.shape[-1] == DIM + SCALE_BYTES
        assert torch.equal(stored, quantize(key))  # the new keys landed, quantized
    reference_out = backend._decode(q[layout.num_prefill_tokens:], pages)
    torch.testing.assert_close(kernel_out[layout.num_prefill_tokens:], reference_out,
                               atol=1e-5, rtol=1e-5)
    # Every sequence, the fresh prefill (7, 7) too, attends the keys as stored: the dense
    # result over the dequantized rows, and within int8 rounding of full precision.
    stored = torch.cat([_dense(qi, *(dequantize(quantize(x), torch.float32) for x in (ki, vi)),
                               ctx) for qi, ki, vi, (_, ctx) in zip(
                                   q.split(layout.query_lens), full_k, full_v, seqs,
                                   strict=True)])
    torch.testing.assert_close(kernel_out, stored, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kernel_out, expected, atol=0.05, rtol=0)
    assert not torch.allclose(kernel_out, expected, atol=1e-4, rtol=0)
