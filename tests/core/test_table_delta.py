"""A static batch's table deltas rebuild exactly the null-padded table a full restage writes."""

from __future__ import annotations

import numpy as np
import pytest

from openinfer.backend.cuda.table_delta import TableMirror


def _full(tables: np.ndarray | None, num_rows: int, shape: tuple[int, int]) -> np.ndarray:
    out = np.zeros(shape, np.int32)
    if tables is not None and num_rows:
        out[:num_rows, : tables.shape[1]] = tables[:num_rows]
    return out


def test_deltas_applied_to_the_device_copy_equal_a_full_restage():
    rng = np.random.default_rng(int(np.random.default_rng().integers(2**31)))
    num_seqs, max_blocks = 16, 12
    mirror = TableMirror(num_seqs, max_blocks, max_changed_fraction=0.5)
    device = np.zeros(num_seqs * max_blocks, np.int32)  # what the GPU holds
    tables = None
    for _ in range(300):
        num_rows = int(rng.integers(0, num_seqs + 1))
        if tables is None or rng.random() < 0.2 or tables.shape[0] < num_rows:  # a new batch
            width = int(rng.integers(1, max_blocks + 1))
            tables = rng.integers(1, 1000, (num_rows, width)).astype(np.int32)
            tables[rng.random(tables.shape) < 0.2] = 0
        else:  # the same batch a step later: some rows get a block, some leave
            tables = tables[:num_rows].copy()
            if tables.shape[1] < max_blocks and rng.random() < 0.3:
                tables = np.concatenate([tables, np.zeros((num_rows, 1), np.int32)], axis=1)
            grow = rng.random(num_rows) < 0.2
            tables[grow, -1] = rng.integers(1, 1000, int(grow.sum()))
        delta = mirror.update(tables, num_rows)
        expected = _full(tables, num_rows, (num_seqs, max_blocks))
        if delta is None:
            device[:] = mirror.table.reshape(-1)
        else:
            index, values = delta
            assert index.dtype == np.int32 and values.dtype == np.int32
            device[index] = values
        assert np.array_equal(device.reshape(num_seqs, max_blocks), expected)
        assert np.array_equal(mirror.table, expected)


def test_a_steady_decode_step_sends_only_the_new_blocks():
    mirror = TableMirror(256, 256)
    tables = np.arange(1, 256 * 100 + 1, dtype=np.int32).reshape(256, 100)
    assert mirror.update(tables, 256) is None  # the first step changes everything: full copy
    grown = np.concatenate([tables, np.zeros((256, 1), np.int32)], axis=1)
    grown[::16, 100] = 7  # one sequence in 16 crossed a block boundary
    index, values = mirror.update(grown, 256)
    assert len(index) == 16 and (values == 7).all()
    index, values = mirror.update(grown[:200], 200)  # 56 rows left: their entries become 0
    assert index.size == np.count_nonzero(grown[200:]) and (values == 0).all()


def test_tables_larger_than_the_static_batch_are_refused():
    with pytest.raises(ValueError, match="do not fit"):
        TableMirror(4, 4).update(np.ones((2, 5), np.int32), 2)
