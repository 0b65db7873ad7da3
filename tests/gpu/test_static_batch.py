"""A graph's static batch updated by deltas holds exactly what a full restage writes."""

from __future__ import annotations

import numpy as np
import pytest

from openinfer.backend.base import ForwardBatch

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


def _decode_batch(rng: np.random.Generator, tables: np.ndarray) -> ForwardBatch:
    count = tables.shape[0]
    context = rng.integers(1, 1000, count).astype(np.int32)
    return ForwardBatch(
        token_ids=rng.integers(0, 5000, count).astype(np.int32), positions=context - 1,
        query_start=np.arange(count + 1, dtype=np.int32), context_lens=context, block_tables=tables,
        slot_mapping=rng.integers(0, 10_000, count).astype(np.int32), logits_rows=np.arange(count, dtype=np.int32),
        max_query_len=1, max_context_len=int(context.max()) if count else 0)


def test_delta_fills_equal_full_fills(cuda_backend, rng):
    num_seqs, max_blocks = 32, 24
    by_delta = cuda_backend.static_batch(num_seqs, max_blocks)
    full_each_time = cuda_backend.static_batch(num_seqs, max_blocks)
    full_each_time._mirror = None  # the plain path: every section in full
    tables = rng.integers(1, 900, (20, 10)).astype(np.int32)
    for step in range(60):
        count = int(rng.integers(1, num_seqs + 1))
        if step % 7 == 0 or count > tables.shape[0]:
            tables = rng.integers(1, 900, (count, int(rng.integers(1, max_blocks + 1)))).astype(np.int32)
        else:  # a decode step later: some sequences left, some crossed a block boundary
            tables = tables[:count].copy()
            if tables.shape[1] < max_blocks:
                tables = np.concatenate([tables, np.zeros((count, 1), np.int32)], axis=1)
            grew = rng.random(count) < 0.3
            tables[grew, -1] = rng.integers(1, 900, int(grew.sum()))
        batch = _decode_batch(rng, tables)
        by_delta.fill(batch)
        full_each_time.fill(batch)
        cupy.cuda.get_current_stream().synchronize()
        np.testing.assert_array_equal(by_delta.buffer.get(), full_each_time.buffer.get())
    # a new batch every few steps here (measured on an H100: 62 % of the full path's ids); in
    # steady decode only the new blocks go (tests/core/test_table_delta.py)
    assert by_delta.num_table_entries_sent < 0.8 * full_each_time.num_table_entries_sent


def test_static_prefill_batch_delta_fills_equal_full_fills_and_pad(cuda_backend, rng):
    """A short-prefill graph's static batch: the real step packed at the front, padding that
    belongs to no sequence, fixed tiles; table deltas hold what a full restage writes."""
    num_seqs, num_tokens, max_blocks = 4, 19, 24
    by_delta = cuda_backend.static_prefill_batch(num_seqs, num_tokens, max_blocks, 16)
    full_each_time = cuda_backend.static_prefill_batch(num_seqs, num_tokens, max_blocks, 16)
    full_each_time._mirror.max_changed = -1  # every fill a full restage
    for _ in range(30):
        count = int(rng.integers(1, num_seqs + 1))
        new = rng.integers(1, 17, count)
        while new.sum() > num_tokens:
            new[int(np.argmax(new))] -= 1
        cached = rng.integers(0, 200, count)
        width = int(-(-(cached + new).max() // 16))
        tables = rng.integers(1, 900, (count, width)).astype(np.int32)
        batch = ForwardBatch.over_blocks(tables, cached.tolist(), new.tolist(), 16,
                                         token_ids=rng.integers(0, 5000, int(new.sum())))
        by_delta.fill(batch)
        full_each_time.fill(batch)
        cupy.cuda.get_current_stream().synchronize()
        np.testing.assert_array_equal(by_delta.buffer.get(), full_each_time.buffer.get())
        device = by_delta.batch
        k = batch.num_tokens
        np.testing.assert_array_equal(device.token_ids.get()[:k], batch.token_ids)
        np.testing.assert_array_equal(device.slot_mapping.get()[k:], -1)  # padded rows write no KV
        np.testing.assert_array_equal(device.query_start.get(), np.r_[batch.query_start, np.full(num_seqs - count, k)])
        np.testing.assert_array_equal(device.context_lens.get()[count:], 0)
        np.testing.assert_array_equal(device.logits_rows.get()[:count], batch.logits_rows)
        np.testing.assert_array_equal(device.block_tables.get()[:count, :width], tables)
        np.testing.assert_array_equal(device.tile_seq.get(), np.arange(num_seqs))
        np.testing.assert_array_equal(device.tile_query.get(), 0)
        assert device.max_query_len == 16 and not device.is_decode
    assert by_delta.num_table_entries_sent < full_each_time.num_table_entries_sent
    too_long = ForwardBatch.over_blocks(np.ones((1, 2), np.int32), [0], [17], 16)
    with pytest.raises(ValueError, match="does not fit"):
        by_delta.fill(too_long)
