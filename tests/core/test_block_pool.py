from openinfer.kv import BlockPool, KVCacheManager, hash_block_tokens
from openinfer.kv.block_pool import NULL_BLOCK_ID


def test_allocate_takes_lowest_ids_and_reserves_null_block():
    pool = BlockPool(num_blocks=6, block_size=4)
    assert pool.num_usable_blocks == 5
    assert pool.allocate(2) == [1, 2]
    assert pool.allocate(3) == [3, 4, 5]
    assert not pool.can_allocate(1)
    assert NULL_BLOCK_ID not in pool.free_queue


def test_free_returns_blocks_and_uncached_blocks_are_reused_first():
    pool = BlockPool(num_blocks=6, block_size=4)
    a = pool.allocate(2)
    pool.cache_full_block(a[0], hash_block_tokens(None, [1, 2, 3, 4]), [1, 2, 3, 4])
    pool.free(list(reversed(a)))
    assert pool.num_free_blocks == 5
    # block 2 (uncached) goes to the front, block 1 (cached) to the back of the eviction order
    assert list(pool.free_queue)[0] == 2
    assert list(pool.free_queue)[-1] == 1


def test_prefix_hit_after_owner_finished_and_lru_eviction():
    pool = BlockPool(num_blocks=4, block_size=2)
    manager = KVCacheManager(pool)
    tokens = [5, 6, 7, 8, 9]
    assert manager.start_request("a", tokens) == 0
    assert manager.grow("a", 5)
    assert manager.block_ids("a") == [1, 2, 3]
    manager.publish_full_blocks("a", tokens, 5)
    assert pool.num_cached_blocks == 2
    manager.free_request("a")
    assert pool.num_used_blocks == 0
    # same prefix: 2 full blocks cached, but the last prompt token is always recomputed
    assert manager.start_request("b", [5, 6, 7, 8, 1]) == 4
    assert manager.block_ids("b") == [1, 2]
    assert manager.grow("b", 5)
    assert manager.block_ids("b") == [1, 2, 3]
    manager.free_request("b")
    # a prompt that is exactly two blocks reuses only the first (last token recomputed)
    assert manager.start_request("c", [5, 6, 7, 8]) == 2
    manager.free_request("c")
    # allocating everything evicts the cached blocks (LRU) and the cache forgets them
    taken = pool.allocate(3)
    assert sorted(taken) == [1, 2, 3]
    assert pool.num_cached_blocks == 0
    pool.free(taken)


def test_hash_chain_depends_on_parent_and_extra_key():
    first = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(first, [3, 4]) != hash_block_tokens(None, [3, 4])
    assert hash_block_tokens(None, [1, 2], extra_key="lora-a") != first


def test_lookup_compares_tokens_not_only_hashes():
    pool = BlockPool(num_blocks=3, block_size=2)
    block = pool.allocate(1)[0]
    h = hash_block_tokens(None, [1, 2])
    pool.cache_full_block(block, h, [1, 2])
    assert pool.lookup(h, [1, 2]) == block
    assert pool.lookup(h, [9, 9]) is None  # a colliding hash never serves wrong KV


def test_prefix_cache_disabled():
    pool = BlockPool(num_blocks=4, block_size=2, enable_prefix_cache=False)
    manager = KVCacheManager(pool)
    manager.start_request("a", [1, 2, 3])
    manager.grow("a", 3)
    manager.publish_full_blocks("a", [1, 2, 3], 3)
    manager.free_request("a")
    assert manager.start_request("b", [1, 2, 3]) == 0
    manager.free_request("b")
    assert pool.num_used_blocks == 0
