"""FlashInfer paged attention for CUDA: the same NHD pages and block tables as the torch path."""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, BatchLayout

_WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferBackend(AttentionBackend):
    """Prefill sequences through `BatchPrefillWithPagedKVCacheWrapper`, single-token ones
    through `BatchDecodeWithPagedKVCacheWrapper`; both planned once per step."""

    name = "flashinfer"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 device: torch.device) -> None:
        import flashinfer

        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")

    def begin_step(self, layout: BatchLayout) -> None:
        bs = layout.block_size
        self.layout = layout
        self.slot_blocks = layout.slot_mapping // bs
        self.slot_offsets = layout.slot_mapping % bs
        self.num_prefill_tokens = layout.num_prefill_tokens
        n = layout.num_prefills
        self.has_prefill = n > 0
        self.has_decode = n < len(layout.query_lens)
        self.planned = False

    def _plan(self, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
        """Plan once per step, at the first layer, when the tensors' dtypes are known:
        FlashInfer assumes float16 unless told, and `run` rejects any other q dtype."""
        layout, n, bs = self.layout, self.layout.num_prefills, self.layout.block_size
        dtypes = {"q_data_type": q_dtype, "kv_data_type": kv_dtype}
        if self.has_prefill:
            indptr, indices, last = _paged_args(layout, 0, n)
            qo_indptr = _indptr(layout.query_lens[:n], indptr.device)
            self.prefill.plan(qo_indptr, indptr, indices, last, self.num_heads,
                              self.num_kv_heads, self.head_dim, bs, causal=True, **dtypes)
        if self.has_decode:
            indptr, indices, last = _paged_args(layout, n, len(layout.query_lens))
            self.decode.plan(indptr, indices, last, self.num_heads, self.num_kv_heads,
                             self.head_dim, bs, **dtypes)
        self.planned = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_layer: torch.Tensor) -> torch.Tensor:
        if not self.planned:
            self._plan(q.dtype, kv_layer.dtype)
        kv_layer[self.slot_blocks, 0, self.slot_offsets] = k
        kv_layer[self.slot_blocks, 1, self.slot_offsets] = v
        split = self.num_prefill_tokens
        parts = []
        if self.has_prefill:
            parts.append(self.prefill.run(q[:split], kv_layer))
        if self.has_decode:
            parts.append(self.decode.run(q[split:], kv_layer))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def _indptr(lengths: list[int], device: torch.device) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    out[1:] = torch.tensor(lengths, dtype=torch.int32, device=device).cumsum(0)
    return out


def _paged_args(layout: BatchLayout, lo: int,
                hi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR page lists (indptr, indices, last_page_len) for sequences lo..hi."""
    bs = layout.block_size
    device = layout.block_tables.device
    ctx = layout.context_lens[lo:hi]
    pages = [-(-c // bs) for c in ctx]
    indices = torch.cat([layout.block_tables[lo + i, :p] for i, p in enumerate(pages)])
    last = torch.tensor([c - (p - 1) * bs for c, p in zip(ctx, pages, strict=True)],
                        dtype=torch.int32, device=device)
    return _indptr(pages, device), indices.to(torch.int32), last
