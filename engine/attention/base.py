"""The attention backend interface and the per-step batch layout all backends read."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class BatchLayout:
    """Where each sequence's tokens sit in the flattened batch and in the KV pages.

    Prefill-type sequences (more than one new token) come first, then single-token
    (decode-type) sequences.

    Args:
        query_lens: new tokens per sequence, `[num_seqs]`.
        context_lens: tokens in the KV cache after this step, `[num_seqs]`.
        block_tables: page ids per sequence, padded with 0, `[num_seqs, max_blocks]`.
        slot_mapping: flat KV slot (`block_id * block_size + offset`) per new token, `[T]`.
        num_prefills: sequences with more than one new token (the first ones).
        block_size: tokens per page.
    """

    query_lens: list[int]
    context_lens: list[int]
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    num_prefills: int
    block_size: int

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.query_lens[:self.num_prefills])


class AttentionBackend(ABC):
    """Computes paged attention for one layer, after writing the step's new KV."""

    name: str

    @abstractmethod
    def begin_step(self, layout: BatchLayout) -> None:
        """Prepare whatever index tensors the step needs (called once per step)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_layer: torch.Tensor) -> torch.Tensor:
        """Write `k`, `v` into `kv_layer` and attend.

        Args:
            q: `[T, num_heads, head_dim]`.
            k: `[T, num_kv_heads, head_dim]`.
            v: `[T, num_kv_heads, head_dim]`.
            kv_layer: `[num_blocks, 2, block_size, num_kv_heads, head_dim]`.

        Returns:
            `[T, num_heads, head_dim]`.
        """
