"""Reference-counted KV blocks with content-addressed prefix caching and LRU eviction."""

from __future__ import annotations

import array
import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence


class NoFreeBlocksError(RuntimeError):
    """The pool cannot supply the blocks asked for."""


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Chained hash of one full block: it names the block's tokens and every token before."""
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    # The tokens as native int64s (numpy's bytes, without a numpy call per block).
    digest.update(array.array("q", token_ids))
    return digest.digest()


def hash_blocks(token_ids: Sequence[int], block_size: int, parent: bytes | None = None,
                start_block: int = 0) -> list[bytes]:
    """Hashes of the full blocks of `token_ids`, starting at block `start_block`."""
    hashes = []
    for start in range(start_block * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


class BlockPool:
    """Owns block ids `0..num_blocks-1`.

    A block is in use while its reference count is positive. Freed blocks join an LRU
    queue; a freed block that holds a cached prefix stays findable by its hash until the
    queue hands it out again (eviction).

    Args:
        num_blocks: blocks in the pool.
        enable_prefix_caching: register full blocks by hash and reuse them.
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        # Oldest first: the next block handed out is the least recently freed.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_hits = 0
        self.num_queries = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, num: int) -> list[int]:
        """Take `num` blocks from the LRU end, evicting their cached hashes.

        Raises:
            NoFreeBlocksError: fewer than `num` blocks are free.
        """
        if num > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {num} KV blocks, {self.num_free_blocks} free")
        block_ids = []
        for _ in range(num):
            block_id, _ = self.free_queue.popitem(last=False)
            self._evict(block_id)
            self.ref_cnt[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on blocks found in the prefix cache."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self.free_queue[block_id]
            self.ref_cnt[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference each; blocks reaching zero become reusable (MRU end)."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] <= 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                self.free_queue[block_id] = None

    def lookup(self, block_hash: bytes) -> int | None:
        """The cached block holding this hash, if any."""
        return self.cached.get(block_hash) if self.enable_prefix_caching else None

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        """Register a full, computed block under its chained hash."""
        if not self.enable_prefix_caching or self.block_hash[block_id] is not None:
            return
        # Another block may already hold the same content; keep the first one findable.
        self.cached.setdefault(block_hash, block_id)
        self.block_hash[block_id] = block_hash

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is None:
            return
        if self.cached.get(block_hash) == block_id:
            del self.cached[block_hash]
        self.block_hash[block_id] = None
