"""Maps requests to KV blocks: prefix-cache lookups, slot allocation, freeing."""

from __future__ import annotations

from collections.abc import Sequence

from engine.block_pool import BlockPool, hash_blocks
from engine.request import Request


class KVCacheManager:
    """The scheduler's view of KV memory.

    Args:
        pool: the block pool.
        block_size: tokens per block.
    """

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        # Leading blocks of each request already registered: a step registers only new ones.
        self._num_registered: dict[str, int] = {}

    def block_hashes(self, request: Request) -> list[bytes]:
        """Chained hashes of the request's full blocks, extended as tokens arrive (kept on
        the request, so whoever already hashed its prompt can hand them over)."""
        hashes = request.block_hashes
        # Only hash when a block filled up: called for every request every step.
        num_full = request.num_tokens // self.block_size
        if num_full > len(hashes):
            parent = hashes[-1] if hashes else None
            new_tokens = request.token_ids(len(hashes) * self.block_size,
                                           num_full * self.block_size)
            hashes.extend(hash_blocks(new_tokens, self.block_size, parent))
        return hashes

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Leading blocks of the request already in the prefix cache.

        At least one token is always left to compute, so the request gets logits.
        """
        if not self.pool.enable_prefix_caching:
            return []
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        block_ids = []
        for block_hash in self.block_hashes(request)[:max_hit_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        self.pool.num_queries += request.num_tokens
        self.pool.num_hits += len(block_ids) * self.block_size
        return block_ids

    def blocks_needed(self, request: Request, num_new_tokens: int,
                      computed_blocks: Sequence[int] = ()) -> int:
        """New blocks `allocate_slots` would take from the free queue."""
        total = request.num_computed_tokens + len(computed_blocks) * self.block_size
        needed = -(-(total + num_new_tokens) // self.block_size)
        held = len(request.block_ids) + len(computed_blocks)
        # Cache hits that sit in the free queue stop being free once touched.
        revived = sum(1 for b in computed_blocks if self.pool.ref_cnt[b] == 0)
        return max(needed - held, 0) + revived

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: Sequence[int] = ()) -> bool:
        """Give the request room for `num_new_tokens` more tokens.

        Args:
            request: the request; its `block_ids` grow.
            num_new_tokens: tokens to be computed (or received) next.
            computed_blocks: prefix-cache hits to adopt first (new requests only).

        Returns:
            False, changing nothing, when the pool lacks blocks.
        """
        if computed_blocks:
            if self.blocks_needed(request, num_new_tokens, computed_blocks) > \
                    self.pool.num_free_blocks:
                return False
            self.pool.touch(computed_blocks)
            request.block_ids.extend(computed_blocks)
            request.num_computed_tokens += len(computed_blocks) * self.block_size
            request.num_cached_tokens = request.num_computed_tokens
        # Without hits (a running request's next tokens, the common case) this is
        # `blocks_needed` in short; with them the check above already covered it.
        total = request.num_computed_tokens + num_new_tokens
        missing = -(-total // self.block_size) - len(request.block_ids)
        if missing > self.pool.num_free_blocks:
            return False
        if missing > 0:
            request.block_ids.extend(self.pool.allocate(missing))
        return True

    def trim(self, request: Request) -> None:
        """Free the blocks past the request's computed tokens (slots reserved for drafts
        that verification rejected); they were never registered in the prefix cache."""
        keep = -(-request.num_computed_tokens // self.block_size)
        if len(request.block_ids) > keep:
            self.pool.free(reversed(request.block_ids[keep:]))
            del request.block_ids[keep:]

    def cache_blocks(self, request: Request) -> None:
        """Register the request's full, computed blocks in the prefix cache (new ones only)."""
        if not self.pool.enable_prefix_caching:
            return
        done = self._num_registered.get(request.request_id, 0)
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= done:
            return
        hashes = self.block_hashes(request)
        for block_id, block_hash in zip(request.block_ids[done:num_full], hashes[done:num_full],
                                        strict=True):
            self.pool.cache_block(block_id, block_hash)
        self._num_registered[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so prefixes outlive suffixes in the LRU."""
        self.pool.free(reversed(request.block_ids))
        request.block_ids = []
        self._num_registered.pop(request.request_id, None)

    def reset(self, request: Request) -> None:
        """Free for recompute (preemption): blocks go, hashes of the tokens stay valid."""
        self.pool.free(reversed(request.block_ids))
        request.block_ids = []
        request.num_computed_tokens = 0
        request.draft_num_computed = 0
        self._num_registered.pop(request.request_id, None)
