import pytest

from engine.block_pool import BlockPool, NoFreeBlocksError, hash_blocks
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams


def test_allocate_hands_out_lowest_ids_first_then_lru():
    pool = BlockPool(6)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    pool.free([1, 0])
    # Free queue order: 5 (never used), then 1, then 0.
    assert pool.allocate(3) == [5, 1, 0]
    assert pool.num_free_blocks == 0
    with pytest.raises(NoFreeBlocksError, match="need 1 KV blocks, 0 free"):
        pool.allocate(1)


def test_ref_counts_and_double_free():
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    pool.touch([b])
    pool.free([b])
    assert pool.num_free_blocks == 1
    pool.free([b])
    assert pool.num_free_blocks == 2
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([b])


def test_cached_block_survives_free_until_evicted():
    pool = BlockPool(3)
    h = hash_blocks(list(range(4)), 4)[0]
    [b] = pool.allocate(1)
    pool.cache_block(b, h)
    pool.free([b])
    assert pool.lookup(h) == 0
    pool.touch([0])  # revived from the free queue
    assert pool.num_free_blocks == 2
    pool.free([0])
    # LRU: 1 and 2 go before 0; taking all three evicts the cached hash.
    assert pool.allocate(2) == [1, 2]
    assert pool.lookup(h) == 0
    assert pool.allocate(1) == [0]
    assert pool.lookup(h) is None


def test_chained_hash_depends_on_every_earlier_token():
    a = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = hash_blocks([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]
    assert hash_blocks([1, 2, 3, 4, 5], 4) == a[:1]


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def test_manager_reuses_prefix_blocks_with_exact_ids():
    manager = KVCacheManager(BlockPool(8), block_size=4)
    first = _request("a", list(range(10)))  # blocks: 2 full + 1 partial
    assert manager.allocate_slots(first, 10)
    assert first.block_ids == [0, 1, 2]
    first.num_computed_tokens = 10
    manager.cache_blocks(first)
    second = _request("b", [*list(range(8)), 99, 98, 97])
    hits = manager.get_computed_blocks(second)
    assert hits == [0, 1]
    assert manager.allocate_slots(second, 3, hits)
    assert second.block_ids == [0, 1, 3]
    assert second.num_computed_tokens == 8
    assert manager.pool.ref_cnt[:4] == [2, 2, 1, 1]
    manager.free(first)
    manager.free(second)
    assert manager.pool.num_free_blocks == 8


def test_full_prompt_hit_still_leaves_one_token_to_compute():
    manager = KVCacheManager(BlockPool(4), block_size=4)
    first = _request("a", list(range(8)))
    manager.allocate_slots(first, 8)
    first.num_computed_tokens = 8
    manager.cache_blocks(first)
    again = _request("b", list(range(8)))
    assert manager.get_computed_blocks(again) == [0]


def test_allocate_slots_refuses_without_side_effects():
    manager = KVCacheManager(BlockPool(2), block_size=4)
    request = _request("a", list(range(12)))
    assert not manager.allocate_slots(request, 12)
    assert request.block_ids == [] and manager.pool.num_free_blocks == 2


class _RecordingPool(BlockPool):
    """A real pool that also records every registration it is asked for."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.registered: list[int] = []

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        self.registered.append(block_id)
        super().cache_block(block_id, block_hash)


def test_cache_blocks_registers_only_blocks_that_filled_since_the_last_step():
    # Bookkeeping per step must follow the new blocks, not rescan a long request's history.
    pool = _RecordingPool(16)
    manager = KVCacheManager(pool, block_size=4)
    request = _request("a", list(range(30)))
    assert manager.allocate_slots(request, 30)
    request.num_computed_tokens = 30
    manager.cache_blocks(request)
    assert pool.registered == [0, 1, 2, 3, 4, 5, 6]
    for token in range(100, 106):  # six decode steps: tokens 31..36 fill blocks 7 and 8
        request.append_token(token)
        assert manager.allocate_slots(request, 1)
        request.num_computed_tokens += 1
        manager.cache_blocks(request)
    assert pool.registered == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert request.block_ids == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    manager.reset(request)  # preempted: recomputed blocks are registered again
    assert manager.allocate_slots(request, 36)
    request.num_computed_tokens = 36
    manager.cache_blocks(request)
    assert pool.registered[9:] == request.block_ids[:9]
    manager.free(request)
    assert pool.num_free_blocks == 16
