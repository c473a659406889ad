"""Paged attention in plain torch: the CPU path and the reference for the others."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, BatchLayout
from engine.kernels import cpu_kernels
from engine.kv_quant import dequantize, quantize

# A prompt of at most this many new tokens over cached context (a speculative verify step:
# the last token and its drafts; a short uncached suffix) attends on CPU as that many
# decode queries through the paged-decode kernel, each seeing up to its own position:
# no gathered copy of the context, no masked SDPA.
SHORT_QUERY = 16


class TorchAttentionBackend(AttentionBackend):
    """Prefills attend with SDPA; decodes on CPU with one kernel call per layer that reads
    the KV pages in place (`engine/csrc/paged_decode.cpp`), elsewhere with SDPA per sequence over
    exactly its gathered pages (the reference the kernel is tested against). Short prompts
    over cached context (`SHORT_QUERY`) take the kernel too, one query per token.

    int8 pages (`engine/kv_quant.py`) are written quantized; the kernel dequantizes rows as
    it reads them, and a prefill over cached blocks dequantizes only that sequence's
    gathered pages, so no full-precision copy of the cache is made. A fresh prompt attends
    its keys as stored too (quantized and back), so it attends the same values whether its
    prefix came from the cache, a transfer or this step.
    """

    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def begin_step(self, layout: BatchLayout) -> None:
        bs = layout.block_size
        self.slot_blocks = layout.slot_mapping // bs
        self.slot_offsets = layout.slot_mapping % bs
        device = layout.block_tables.device
        # Decodes (and short queries) read the pages in place through the CPU kernel.
        self.in_place = device.type == "cpu" and cpu_kernels() is not None
        self.prefills = []
        rows: list[int] = []
        tables, lens = [], []
        start = 0
        for i in range(layout.num_prefills):
            q_len, ctx_len = layout.query_lens[i], layout.context_lens[i]
            if self.in_place and q_len < ctx_len and q_len <= SHORT_QUERY:
                # Query j sees the context up to its own position: a decode query over
                # ctx_len - q_len + j + 1 tokens of the same pages.
                rows += range(start, start + q_len)
                tables.append(layout.block_tables[i].expand(q_len, -1))
                lens += range(ctx_len - q_len + 1, ctx_len + 1)
            else:
                num_blocks = -(-ctx_len // bs)
                self.prefills.append((start, q_len, ctx_len,
                                      layout.block_tables[i, :num_blocks],
                                      _causal_mask(q_len, ctx_len, device)))
            start += q_len
        self.short = None if not rows else (
            torch.tensor(rows, dtype=torch.long), torch.cat(tables).contiguous(),
            torch.tensor(lens, dtype=torch.long))
        self.decode_start = start
        self._begin_decode(layout)

    def _begin_decode(self, layout: BatchLayout) -> None:
        bs = layout.block_size
        self.decodes = [(layout.block_tables[layout.num_prefills + i, :-(-ctx_len // bs)], ctx_len)
                        for i, ctx_len in enumerate(layout.context_lens[layout.num_prefills:])]
        self.decode_tables = layout.block_tables[layout.num_prefills:]
        self.decode_lens = torch.tensor(layout.context_lens[layout.num_prefills:],
                                        dtype=torch.long)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_layer: torch.Tensor) -> torch.Tensor:
        if kv_layer.dtype == torch.int8:
            k, v = quantize(k), quantize(v)
            kv_layer[self.slot_blocks, 0, self.slot_offsets] = k
            kv_layer[self.slot_blocks, 1, self.slot_offsets] = v
            if self.prefills:  # what the pages now hold, for prompts attending fresh keys
                k, v = dequantize(k, q.dtype), dequantize(v, q.dtype)
        else:
            kv_layer[self.slot_blocks, 0, self.slot_offsets] = k
            kv_layer[self.slot_blocks, 1, self.slot_offsets] = v
        if self.in_place and not self.prefills and self.short is None:  # decodes only
            return paged_decode(q, kv_layer, self.decode_tables, self.decode_lens)
        out = torch.empty_like(q)
        for start, q_len, ctx_len, table, mask in self.prefills:
            end = start + q_len
            if ctx_len == q_len:  # nothing cached before: attend to the fresh keys
                out[start:end] = self._attend(q[start:end], k[start:end], v[start:end], None)
            else:
                keys, values = _gather(kv_layer, table, ctx_len, q.dtype)
                out[start:end] = self._attend(q[start:end], keys, values, mask)
        if self.short is not None:
            rows, tables, lens = self.short
            out[rows] = paged_decode(q[rows], kv_layer, tables, lens)
        if self.decodes:
            q_dec = q[self.decode_start:]
            out[self.decode_start:] = paged_decode(q_dec, kv_layer, self.decode_tables,
                                                   self.decode_lens) \
                if self.in_place else self._decode(q_dec, kv_layer)
        return out

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        # [L, H, D] -> [1, H, L, D]
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                             enable_gqa=True)
        return out[0].transpose(0, 1)

    def _decode(self, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        # One sequence at a time over exactly its own context: a padded batch would pay for
        # the longest context in every row and force a masked (slower) SDPA path.
        group = self.num_heads // self.num_kv_heads
        out = torch.empty_like(q)
        for i, (table, ctx_len) in enumerate(self.decodes):
            keys, values = (x.transpose(0, 1).unsqueeze(0)  # [1, H, S, D]
                            for x in _gather(kv_layer, table, ctx_len, q.dtype))
            # The query heads sharing a KV head act as that head's queries: no KV repeat needed.
            grouped = q[i].view(1, self.num_kv_heads, group, self.head_dim)
            out[i] = F.scaled_dot_product_attention(grouped, keys, values).view(
                self.num_heads, self.head_dim)
        return out


def _gather(kv_layer: torch.Tensor, table: torch.Tensor, ctx_len: int,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's keys and values, `[ctx_len, H, D]` each of `dtype`, from its pages
    (int8 pages dequantized: the copy is this sequence's context, never the pool)."""
    keys, values = (kv_layer[:, i].index_select(0, table).flatten(0, 1)[:ctx_len]
                    for i in (0, 1))
    if kv_layer.dtype == torch.int8:
        return dequantize(keys, dtype), dequantize(values, dtype)
    return keys, values


def _causal_mask(q_len: int, ctx_len: int, device: torch.device) -> torch.Tensor:
    """Query i (at absolute position ctx_len - q_len + i) sees keys up to its position."""
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)
    return torch.arange(ctx_len, device=device)[None, :] <= q_pos[:, None]


def paged_decode(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor) -> torch.Tensor:
    """One query token per sequence attending over its KV pages, read in place (CPU).

    Args:
        q: `[B, num_heads, head_dim]`.
        kv_layer: `[num_blocks, 2, block_size, num_kv_heads, head_dim]` of q's dtype, or
            int8 `[..., head_dim + 4]` (`engine/kv_quant.py`), contiguous.
        block_tables: int64 `[B, max_blocks]`.
        context_lens: int64 `[B]`, the tokens each query sees (its own included).

    Returns:
        `[B, num_heads, head_dim]`.
    """
    kernels = cpu_kernels()
    if kernels is None:
        raise RuntimeError("the CPU paged-decode kernel could not be built (see the log)")
    return kernels.paged_decode(q, kv_layer, block_tables, context_lens,
                                1.0 / math.sqrt(q.shape[-1]))
