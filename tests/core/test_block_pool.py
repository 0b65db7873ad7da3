import numpy as np
import pytest

from openinfer.kv import BlockPool, KVCacheManager, hash_block_tokens
from openinfer.kv.block_pool import NULL_BLOCK_ID, token_bytes


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


def test_prefix_hashes_are_the_block_chain_hashed_once(monkeypatch):
    from openinfer.kv import block_pool

    hashed: list[int] = []
    chain = block_pool.chain_block_hashes

    def counting_chain(parent, data, block_size, extra_key=""):
        hashed.append(len(data) // (block_pool.TOKEN_WIDTH * block_size))
        return chain(parent, data, block_size, extra_key)

    monkeypatch.setattr(block_pool, "chain_block_hashes", counting_chain)
    tokens = [7, 1, 4, 4, 2, 9, 3, 3, 8]
    expected, parent = [], None
    for i in range(4):
        parent = hash_block_tokens(parent, tokens[2 * i : 2 * i + 2], "salt")
        expected.append(parent)
    prefix = block_pool.PrefixHashes(block_size=2, extra_key="salt")
    assert prefix.extend(tokens, 2) == expected[:2]
    assert prefix.extend(tokens, 4) == expected  # only the two new blocks are hashed
    assert prefix.extend(tokens, 3)[:3] == expected[:3]
    assert hashed == [2, 2]
    assert prefix.token_bytes(1, 3) == block_pool.token_bytes(tokens[2:6])
    # a block holding a token not read back yet (a placeholder) is left unhashed, and all after it
    waiting = block_pool.PrefixHashes(block_size=2, extra_key="salt")
    assert waiting.extend(tokens[:5] + [-1, 3, 3], 4) == expected[:2]


def test_lookup_prefix_stops_at_the_first_miss_or_token_mismatch():
    pool = BlockPool(num_blocks=5, block_size=2)
    prefix = [1, 2, 3, 4, 5, 6]
    hashes, parent = [], None
    for i in range(3):
        parent = hash_block_tokens(parent, prefix[2 * i : 2 * i + 2])
        hashes.append(parent)
    blocks = pool.allocate(2)
    for block, h, i in zip(blocks, hashes[:2], (0, 1), strict=True):
        pool.cache_full_block(block, h, prefix[2 * i : 2 * i + 2])
    data = token_bytes(prefix)
    assert pool.lookup_prefix(hashes, data) == blocks  # the third block is not cached
    # the same hashes over other tokens (a collision): the run ends at the first block that differs
    other = token_bytes([1, 2, 9, 9, 5, 6])
    assert pool.lookup_prefix(hashes, other) == blocks[:1]
    assert BlockPool(num_blocks=3, block_size=2, enable_prefix_cache=False).lookup_prefix(hashes, data) == []


def test_a_request_restarted_or_retried_reuses_its_hashes_and_salts_stay_apart(monkeypatch):
    from openinfer.kv import block_pool

    hashed: list[int] = []
    chain = block_pool.chain_block_hashes
    monkeypatch.setattr(block_pool, "chain_block_hashes",
                        lambda parent, data, bs, key="": hashed.append(len(data) // (block_pool.TOKEN_WIDTH * bs)) or chain(parent, data, bs, key))
    pool = BlockPool(num_blocks=12, block_size=2)
    manager = KVCacheManager(pool)
    tokens = list(range(3, 14))  # 11 tokens: 5 full blocks
    prefix = manager.prefix_hashes()
    assert manager.start_request("a", tokens, prefix=prefix) == 0
    assert manager.grow("a", 11)
    manager.publish_full_blocks("a", tokens, 11)
    manager.free_request("a")  # preempted, or refused for lack of blocks: it will start again
    assert manager.start_request("a", tokens, prefix=prefix) == 10
    manager.free_request("a")
    assert sum(hashed) == 5  # every block hashed once over the request's life
    # another cache salt never hits these blocks, even given a hash cache of the unsalted key
    assert manager.start_request("s", tokens, cache_salt="tenant-b", prefix=prefix) == 0
    manager.free_request("s")
    salted = manager.prefix_hashes("tenant-b")
    assert manager.start_request("t", tokens, cache_salt="tenant-b", prefix=salted) == 0
    assert manager.grow("t", 11)
    manager.publish_full_blocks("t", tokens, 11)
    manager.free_request("t")
    assert manager.start_request("u", tokens, cache_salt="tenant-b") == 10
    assert manager.find_cached_prefix(tokens)[1] == prefix.hashes[:5]
    manager.free_request("u")
    assert pool.num_used_blocks == 0


def test_memoized_chain_hashes_equal_the_hash_chain_and_the_memo_stays_bounded(monkeypatch):
    from openinfer.kv import block_pool

    memo = block_pool._HashMemo(capacity=8)
    monkeypatch.setattr(block_pool, "_MEMO", memo)
    rng = np.random.default_rng(3)
    shared = rng.integers(0, 50_000, 4 * 6).tolist()
    for round_ in range(4):  # the same prefix again (memo hits), then new tails (misses, trimming)
        tokens = shared + rng.integers(0, 50_000, 4 * round_).tolist()
        expected, parent = [], None
        for i in range(len(tokens) // 4):
            parent = hash_block_tokens(parent, tokens[4 * i : 4 * i + 4], "k")
            expected.append(parent)
        got = block_pool.chain_block_hashes(None, block_pool.token_bytes(tokens), 4, "k")
        assert got == expected
        assert len(memo.table) <= memo.capacity
    assert memo.table  # it remembers the latest blocks


def test_prefix_hashes_from_the_prompt_array_equal_those_from_the_token_list():
    """A request's hash cache made with its prompt's array (the engine's) gives the same hashes
    as one reading token_ids' list, for the prompt's blocks and for blocks past it (generated
    tokens, read from the list), and stops at a placeholder the same way."""
    from openinfer.kv import block_pool

    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 50_000, 16 * 9 + 5)
    tokens = prompt.tolist() + rng.integers(0, 50_000, 40).tolist()
    from_list = block_pool.PrefixHashes(block_size=16, extra_key="k")
    from_array = block_pool.PrefixHashes(block_size=16, extra_key="k", known_tokens=prompt.astype(np.int32))
    for num_blocks in (3, 9, 12):  # inside the prompt, its last full block, past it
        assert from_array.extend(tokens, num_blocks) == from_list.extend(tokens, num_blocks)
        assert from_array.token_bytes(0, num_blocks) == from_list.token_bytes(0, num_blocks)
    expected = [hash_block_tokens(None, tokens[:16], "k")]
    assert from_array.hashes[0] == expected[0]
    waiting = block_pool.PrefixHashes(block_size=16, known_tokens=prompt)
    assert len(waiting.extend(tokens[:16 * 9 + 5] + [-1] * 40, 12)) == 9  # placeholders stop it


def test_a_prompt_starting_like_an_earlier_one_takes_its_chain_with_the_same_hashes(monkeypatch):
    """The chain memo: a sequence whose leading blocks equal a remembered one's takes those
    hashes from it (no per-block hashing), hashes the rest itself, and every hash equals the
    plain block chain's, whether the two diverge in the first, a middle or no block; at most
    ``capacity`` chains are remembered."""
    from openinfer.kv import block_pool

    monkeypatch.setattr(block_pool, "_CHAINS", block_pool._ChainMemo(2))
    hashed: list[int] = []
    chain = block_pool.chain_block_hashes
    monkeypatch.setattr(block_pool, "chain_block_hashes",
                        lambda parent, data, bs, key="": hashed.append(len(data) // (block_pool.TOKEN_WIDTH * bs))
                        or chain(parent, data, bs, key))
    rng = np.random.default_rng(5)
    base = rng.integers(0, 50_000, 8 * 20).tolist()

    def plain(tokens: list[int], num_blocks: int, key: str) -> list[bytes]:
        hashes, parent = [], None
        for i in range(num_blocks):
            parent = hash_block_tokens(parent, tokens[8 * i : 8 * i + 8], key)
            hashes.append(parent)
        return hashes

    first = block_pool.PrefixHashes(8, "k")
    assert first.extend(base, 12) == plain(base, 12, "k") and hashed == [12]
    assert first.extend(base, 20) == plain(base, 20, "k") and hashed == [12, 8]
    for diverge_at, expected_hashed in ((20, []), (13, [7]), (1, [19])):  # tokens from this block on differ
        other = base[: 8 * diverge_at] + [t + 1 for t in base[8 * diverge_at :]]
        hashed.clear()
        assert block_pool.PrefixHashes(8, "k").extend(other, 20) == plain(other, 20, "k")
        assert hashed == expected_hashed
    hashed.clear()  # another key: nothing shared
    assert block_pool.PrefixHashes(8, "other").extend(base, 20) == plain(base, 20, "other") and hashed == [20]
    assert len(block_pool._CHAINS.chains) == 2


def test_a_cold_prompt_hashes_only_a_few_blocks_before_its_first_step():
    """Hashes are computed in doubling steps until one is not cached: the rest when published."""
    pool = BlockPool(num_blocks=300, block_size=4)
    kv = KVCacheManager(pool)
    tokens = np.random.default_rng(0).integers(0, 1000, 4 * 256 + 3).astype(np.int32)
    prefix = kv.prefix_hashes("", tokens)
    assert kv.start_request("a", tokens.tolist(), prefix=prefix) == 0
    assert len(prefix.hashes) == 16  # one step of 16: the first is not cached
    assert kv.grow("a", len(tokens))
    kv.publish_full_blocks("a", tokens.tolist(), len(tokens))
    assert len(prefix.hashes) == 256 and pool.num_cached_blocks == 256
    kv.free_request("a")
    # the same prompt again (another request, a new hash cache): a full hit, every hash the same
    again = kv.prefix_hashes("", tokens)
    assert kv.start_request("b", tokens.tolist(), prefix=again) == 4 * 256
    assert again.hashes == prefix.hashes


@pytest.mark.parametrize("seed", range(6))
def test_hits_are_those_of_hashing_every_block(seed):
    """Random prompts sharing random prefixes: the stepped hashing finds exactly the hit the
    whole prompt's hashes find, and publishes the same hashes."""
    rng = np.random.default_rng(seed)
    pools = [BlockPool(num_blocks=400, block_size=4) for _ in range(2)]
    managers = [KVCacheManager(pool) for pool in pools]
    stems = [rng.integers(0, 50, int(rng.integers(4, 300))).tolist() for _ in range(3)]
    for i in range(25):
        stem = stems[int(rng.integers(len(stems)))]
        tokens = stem[: int(rng.integers(1, len(stem) + 1))] + rng.integers(0, 50, int(rng.integers(1, 90))).tolist()
        hits = []
        for j, kv in enumerate(managers):
            prefix = kv.prefix_hashes("")
            if j == 1:  # the reference: every block hashed before the lookup
                prefix.extend(tokens, (len(tokens) - 1) // 4)
            hits.append(kv.start_request(f"r{i}", tokens, prefix=prefix))
            assert kv.grow(f"r{i}", len(tokens))
            kv.publish_full_blocks(f"r{i}", tokens, len(tokens))
            kv.free_request(f"r{i}")
        assert hits[0] == hits[1]
        assert sorted(pools[0].cached) == sorted(pools[1].cached)


def _reference_lookup(pool: BlockPool, hashes: list[bytes], data: bytes) -> list[int]:
    """``lookup_prefix`` from first principles: cached blocks, in order, holding the same tokens."""
    stride = 4 * pool.block_size
    found = []
    for i, block_hash in enumerate(hashes):
        block_id = pool.cached.get(block_hash)
        if block_id is None or pool.blocks[block_id].token_bytes != data[i * stride : (i + 1) * stride]:
            break
        found.append(block_id)
    return found


@pytest.mark.parametrize("seed", range(8))
def test_prefix_lookups_reusing_the_last_one_find_what_a_fresh_lookup_finds(seed):
    """Requests on shared prefixes start, publish and free while a small pool evicts: every
    lookup (reusing the previous one's leading blocks where it may) equals a fresh one."""
    rng = np.random.default_rng(seed)
    pool = BlockPool(num_blocks=int(rng.integers(12, 40)), block_size=2)
    kv = KVCacheManager(pool)
    stems = [rng.integers(0, 9, int(rng.integers(2, 30))).tolist() for _ in range(3)]
    live = []
    for i in range(80):
        stem = stems[int(rng.integers(len(stems)))]
        tokens = stem[: int(rng.integers(1, len(stem) + 1))] + rng.integers(0, 9, int(rng.integers(0, 6))).tolist()
        if len(tokens) < 2:
            continue
        prefix = kv.prefix_hashes("")
        hashes = prefix.extend(tokens, (len(tokens) - 1) // 2)
        data = prefix.token_bytes(0, len(hashes))
        assert pool.lookup_prefix(hashes, data) == _reference_lookup(pool, hashes, data)
        if rng.random() < 0.3 and live:  # a request ends
            kv.free_request(live.pop(int(rng.integers(len(live)))))
        kv.start_request(f"r{i}", tokens, prefix=prefix)
        if kv.grow(f"r{i}", len(tokens)):
            kv.publish_full_blocks(f"r{i}", tokens, len(tokens))
            live.append(f"r{i}")
        else:
            kv.free_request(f"r{i}")
        if len(live) > 3:
            kv.free_request(live.pop(0))


def test_allocation_hands_out_a_freed_run_in_ascending_order():
    """A request's blocks come back tail-first; the next allocation takes them ascending (one run
    of consecutive ids, in table order), the same blocks either way."""
    pool = BlockPool(num_blocks=9, block_size=4)
    table = pool.allocate(8)
    assert table == list(range(1, 9))
    for block_id, tokens in zip(table, range(8), strict=True):
        pool.cache_full_block(block_id, hash_block_tokens(None, [tokens] * 4), [tokens] * 4)
    pool.free(list(reversed(table)))
    assert list(pool.free_queue) == list(range(8, 0, -1))
    assert pool.allocate(3) == [6, 7, 8]  # the least recently freed three, ascending


@pytest.mark.parametrize("seed", range(8))
def test_lookups_through_remembered_prompt_runs_find_what_a_fresh_lookup_finds(seed):
    """Requests whose prompts arrive as arrays (their prompt blocks noted as known runs once
    published) on shared prefixes start, publish and free while a small pool evicts; some are
    cold prompts between warm ones: every lookup equals a fresh one, and so do the hits."""
    rng = np.random.default_rng(seed)
    pool = BlockPool(num_blocks=int(rng.integers(12, 60)), block_size=2)
    kv = KVCacheManager(pool)
    stems = [rng.integers(0, 9, int(rng.integers(2, 40))).tolist() for _ in range(3)]
    live = []
    for i in range(120):
        if rng.random() < 0.2:  # a cold prompt of its own
            tokens = rng.integers(0, 9, int(rng.integers(2, 30))).tolist()
        else:
            stem = stems[int(rng.integers(len(stems)))]
            tokens = stem[: int(rng.integers(1, len(stem) + 1))] + rng.integers(0, 9, int(rng.integers(0, 4))).tolist()
        if len(tokens) < 2:
            continue
        prompt = np.array(tokens, np.int32)
        probe = kv.prefix_hashes("", prompt)
        hashes = probe.extend(tokens, (len(tokens) - 1) // 2)
        data = probe.token_bytes(0, len(hashes))
        assert pool.lookup_prefix(hashes, data) == _reference_lookup(pool, hashes, data)
        if rng.random() < 0.3 and live:
            kv.free_request(live.pop(int(rng.integers(len(live)))))
        expected = len(_reference_lookup(pool, hashes, data)) * 2
        assert kv.start_request(f"r{i}", tokens, prefix=kv.prefix_hashes("", prompt)) == expected
        if kv.grow(f"r{i}", len(tokens)):
            kv.publish_full_blocks(f"r{i}", tokens, len(tokens))
            live.append(f"r{i}")
        else:
            kv.free_request(f"r{i}")
        if len(live) > 3:
            kv.free_request(live.pop(0))


def test_a_published_prompt_is_a_known_run_for_the_next_request_on_it():
    """After a prompt's blocks are published, the same prompt with its last token changed finds
    every block before it from the known run (no per-block probe), the same blocks as a fresh lookup."""
    pool = BlockPool(num_blocks=64, block_size=4)
    kv = KVCacheManager(pool)
    prompt = np.arange(100, 140, dtype=np.int32)  # 10 full blocks
    kv.start_request("cold", prompt.tolist(), prefix=kv.prefix_hashes("", prompt))
    assert kv.grow("cold", 40)
    kv.publish_full_blocks("cold", prompt.tolist(), 40)
    assert not pool._runs  # noted once the step's tokens are sent (the engine settles then)
    kv.settle_frees()
    assert [run[1] for run in pool._runs.values()] == [tuple(kv.block_ids("cold")[:10])]
    kv.free_request("cold")
    warm = prompt.copy()
    warm[-1] += 1
    probes = []
    pool.cached = _CountingDict(pool.cached, probes)
    assert kv.start_request("warm", warm.tolist(), prefix=kv.prefix_hashes("", warm)) == 36
    assert probes == []  # all nine blocks from the run
    assert kv.block_ids("warm")[:9] == list(list(pool._runs.values())[0][1][:9])


class _CountingDict(dict):
    def __init__(self, items, calls):
        super().__init__(items)
        self.calls = calls

    def get(self, key, default=None):
        self.calls.append(key)
        return super().get(key, default)


def test_a_longer_prompt_on_a_known_run_probes_only_its_new_blocks():
    """A turn that extends an earlier prompt (its blocks a known run) is noted with the run's
    blocks and a probe per new block only; a prompt the run already holds changes nothing."""
    pool = BlockPool(num_blocks=64, block_size=4)
    kv = KVCacheManager(pool)

    def serve(name: str, prompt: np.ndarray) -> None:
        kv.start_request(name, prompt.tolist(), prefix=kv.prefix_hashes("", prompt))
        assert kv.grow(name, len(prompt))
        kv.publish_full_blocks(name, prompt.tolist(), len(prompt))
        kv.free_request(name)

    first = np.arange(100, 140, dtype=np.int32)  # 10 blocks
    serve("turn1", first)
    kv.settle_frees()
    second = np.concatenate([first, np.arange(500, 524, dtype=np.int32)])  # 16 blocks
    serve("turn2", second)
    probes = []
    pool.cached = _CountingDict(pool.cached, probes)
    kv.settle_frees()
    assert len(probes) == 6  # only the six new blocks
    [run] = pool._runs.values()
    assert len(run[1]) == 16 and run[1] == tuple(dict.get(pool.cached, h) for h in run[0])
    probes.clear()
    serve("again", first)  # the same first turn again: its blocks from the run, nothing noted anew
    kv.settle_frees()
    assert probes == [] and len(list(pool._runs.values())[0][1]) == 16


def test_the_first_publish_of_a_chunked_prompt_hashes_the_whole_prompt():
    """The first chunk's publish hashes every block of the prompt (the next chunk's device time
    covers it) but publishes only the computed ones; the last chunk's publish hashes nothing."""
    pool = BlockPool(num_blocks=64, block_size=4)
    kv = KVCacheManager(pool)
    prompt = np.arange(100, 140, dtype=np.int32)  # 10 blocks
    prefix = kv.prefix_hashes("", prompt)
    kv.start_request("r", prompt.tolist(), prefix=prefix)
    assert kv.grow("r", 40)
    kv.publish_full_blocks("r", prompt.tolist(), 16)  # the first chunk: 4 blocks computed
    assert len(prefix.hashes) == 10 and len(pool.cached) == 4
    hashed = list(prefix.hashes)
    kv.publish_full_blocks("r", prompt.tolist(), 40)
    assert prefix.hashes == hashed and len(pool.cached) == 10
    reference = KVCacheManager(BlockPool(num_blocks=64, block_size=4)).prefix_hashes("")
    assert reference.extend(prompt.tolist(), 10) == hashed


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_later_prompt_chunk_hashes_the_rest_of_the_prompt_when_planned(use_cache):
    """Growing a request for a later prefill chunk (computed tokens > 0) hashes every block of its
    prompt then (the device is busy with the earlier chunk); a first chunk, or a request that
    does not use the cache, hashes nothing ahead."""
    pool = BlockPool(num_blocks=64, block_size=4)
    kv = KVCacheManager(pool)
    prompt = np.arange(100, 164, dtype=np.int32)  # 16 blocks
    prefix = kv.prefix_hashes("", prompt)
    kv.start_request("r", prompt.tolist(), use_cache, prefix=prefix)
    before = len(prefix.hashes)
    assert kv.grow("r", 24, 0) and len(prefix.hashes) == before
    assert kv.grow("r", 48, 24)
    assert len(prefix.hashes) == (16 if use_cache else before)
    if use_cache:
        reference = KVCacheManager(BlockPool(num_blocks=64, block_size=4)).prefix_hashes("")
        assert prefix.hashes == reference.extend(prompt.tolist(), 16)


def test_publishing_in_bulk_caches_as_one_block_at_a_time():
    """``cache_full_blocks`` (null entries skipped, first writer wins, compressed entries under
    their last block's hash) leaves the pool as ``cache_full_block`` per entry does."""
    rng = np.random.default_rng(5)
    pools = [BlockPool(num_blocks=32, block_size=2) for _ in range(2)]
    for ratio in (1, 2):
        tokens = rng.integers(0, 50, 24).tolist()
        hashes = KVCacheManager(BlockPool(num_blocks=4, block_size=2)).prefix_hashes("").extend(tokens, 12)
        data = token_bytes(tokens)
        ids = pools[0].allocate(12 // ratio)
        assert pools[1].allocate(12 // ratio) == ids
        ids[1] = NULL_BLOCK_ID
        taken = pools[0].allocate(1)
        pools[0].cache_full_block(taken[0], hashes[ratio - 1], data[: 4 * 2 * ratio])  # first writer
        pools[1].allocate(1)
        pools[1].cache_full_block(taken[0], hashes[ratio - 1], data[: 4 * 2 * ratio])
        stride = 4 * 2 * ratio
        for i, block_id in enumerate(ids):
            if block_id != NULL_BLOCK_ID:
                pools[0].cache_full_block(block_id, hashes[(i + 1) * ratio - 1], data[i * stride:(i + 1) * stride])
        pools[1].cache_full_blocks(ids, hashes, data, ratio)
        assert pools[0].cached == pools[1].cached
        assert [(b.block_hash, b.token_bytes) for b in pools[0].blocks] == \
               [(b.block_hash, b.token_bytes) for b in pools[1].blocks]


def test_known_tokens_are_read_in_place_only_when_they_cannot_change():
    """A read-only int32 prompt (the engine core's message) is hashed from where it is; a
    writeable one is copied, so changing it afterwards changes no hash."""
    from openinfer.kv.block_pool import PrefixHashes

    prompt = np.arange(100, 132, dtype=np.int32)
    frozen = prompt.copy()
    frozen.flags.writeable = False
    assert PrefixHashes(4, "", frozen)._known is frozen
    live = prompt.copy()
    prefix = PrefixHashes(4, "", live)
    live[:] = 7
    reference = PrefixHashes(4, "")
    assert prefix.extend([], 8) == reference.extend(prompt.tolist(), 8)
    wide = PrefixHashes(4, "", prompt.astype(np.int64))
    assert wide.extend([], 8) == reference.hashes
