"""``KVCacheManager.defer_frees`` (the engine core's mode): a finished request's blocks go back to
the pool at ``settle_frees`` (after the step's tokens are sent) or before anything allocates or
takes blocks, and the pool then ends exactly as with immediate frees."""

from __future__ import annotations

import numpy as np
import pytest

from openinfer.kv import BlockPool, KVCacheManager


def run(defer: bool, seed: int) -> tuple[list[int], list[int], list[list[int]]]:
    """Requests sharing prefixes start, grow, publish and finish in a random order; returns the
    free queue, the cached block ids and every request's block table as seen at its start."""
    rng = np.random.default_rng(seed)
    pool = BlockPool(num_blocks=64, block_size=4)
    kv = KVCacheManager(pool)
    kv.defer_frees = defer
    prefix = rng.integers(0, 50, 24).tolist()
    live: dict[str, list[int]] = {}
    tables = []
    for i in range(30):
        if live and (rng.random() < 0.5 or len(live) > 3):
            name = list(live)[int(rng.integers(len(live)))]
            kv.free_request(name)
            del live[name]
            if rng.random() < 0.5:
                kv.settle_frees()  # (what the engine does after each step's delivery)
            continue
        tokens = prefix[: int(rng.integers(5, 24))] + rng.integers(0, 50, int(rng.integers(1, 9))).tolist()
        name = f"r{i}"
        kv.start_request(name, tokens)
        assert kv.grow(name, len(tokens))
        kv.publish_full_blocks(name, tokens, len(tokens))
        live[name] = tokens
        tables.append(kv.block_ids(name))
    for name in list(live):
        kv.free_request(name)
    kv.settle_frees()
    return list(pool.free_queue), sorted(pool.cached.values()), tables


@pytest.mark.parametrize("seed", range(8))
def test_deferred_frees_end_as_immediate_ones(seed):
    assert run(True, seed) == run(False, seed)


def test_a_deferred_free_waits_for_the_settle_or_the_next_allocation():
    pool = BlockPool(num_blocks=6, block_size=2)
    kv = KVCacheManager(pool)
    kv.defer_frees = True
    kv.start_request("a", [1, 2, 3, 4, 5])
    assert kv.grow("a", 5) and pool.num_free_blocks == 2
    kv.free_request("a")
    assert pool.num_free_blocks == 2  # still held: nothing allocates until the settle
    kv.settle_frees()
    assert pool.num_free_blocks == 5
    kv.start_request("b", [1, 2, 3, 4, 5])
    assert kv.grow("b", 5)
    kv.free_request("b")
    kv.start_request("c", [9, 9, 9, 9, 9, 9, 9, 9, 9])  # takes blocks: b's come back first
    assert kv.grow("c", 9) and pool.num_free_blocks == 0
