"""Block tables as array rows, updated in place, always equal the per-request lists."""

from __future__ import annotations

import numpy as np

from openinfer.kv import BlockPool, FullAttentionSpec, KVCacheManager, SlidingWindowSpec, group_specs
from openinfer.kv.table_rows import BlockTableRows


def _padded(tables: list[list[int]]) -> np.ndarray:
    width = max(1, max((len(t) for t in tables), default=1))
    return np.array([t + [0] * (width - len(t)) for t in tables], np.int32).reshape(len(tables), width)


def test_rows_follow_random_writes_releases_and_growth():
    rng = np.random.default_rng(int(np.random.default_rng().integers(2**31)))
    rows = BlockTableRows(2, rows=2, width=2)
    live: dict[int, list[list[int]]] = {}
    for _ in range(400):
        action = rng.integers(0, 4)
        if action == 0 or not live:
            row = rows.assign()
            assert row not in live
            live[row] = [[], []]
        elif action == 1:
            row = int(rng.choice(list(live)))
            rows.release(row)
            del live[row]
        else:
            row, group = int(rng.choice(list(live))), int(rng.integers(0, 2))
            table = live[row][group]
            if action == 2 or not table:  # append blocks
                new = rng.integers(1, 10_000, int(rng.integers(1, 6))).tolist()
                rows.write(group, row, len(table), new)
                table.extend(new)
            else:  # a sliding window nulls a prefix
                upto = int(rng.integers(0, len(table) + 1))
                rows.write(group, row, 0, [0] * upto)
                table[:upto] = [0] * upto
        if live:
            chosen = rng.permutation(list(live))[: int(rng.integers(1, len(live) + 1))]
            for group in range(2):
                expected = _padded([live[int(r)][group] for r in chosen])
                assert np.array_equal(rows.gather(group, np.asarray(chosen)), expected)
    assert rows.capacity >= len(live)


def test_the_manager_keeps_its_rows_equal_to_its_tables():
    groups = group_specs([FullAttentionSpec(2, 4), SlidingWindowSpec(2, 4, window=20)])
    pools = [BlockPool(400, 4, enable_prefix_cache=True), BlockPool(400, 4, enable_prefix_cache=True)]
    kv = KVCacheManager(pools, groups=groups, block_size=4)
    rng = np.random.default_rng(3)
    lengths: dict[str, int] = {}
    for step in range(200):
        if len(lengths) < 6 and rng.random() < 0.3:
            request_id = f"r{step}"
            prompt = rng.integers(0, 50, int(rng.integers(1, 30))).tolist()
            kv.start_request(request_id, prompt)
            lengths[request_id] = len(prompt)
            assert kv.grow(request_id, len(prompt))
        elif lengths and rng.random() < 0.1:
            request_id = str(rng.choice(list(lengths)))
            kv.free_request(request_id)
            del lengths[request_id]
        elif lengths:
            request_id = str(rng.choice(list(lengths)))
            lengths[request_id] += int(rng.integers(1, 9))
            assert kv.grow(request_id, lengths[request_id], num_computed_tokens=lengths[request_id] - 1)
        ids = list(lengths)
        rows = kv.table_rows_of(ids)
        for group in range(2):
            expected = _padded([kv.group_tables(r)[group] for r in ids])
            assert np.array_equal(kv.gather_tables(group, rows), expected)
