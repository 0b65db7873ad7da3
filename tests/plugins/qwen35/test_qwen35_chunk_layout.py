"""``gated_deltanet.chunk_layout``: how the CUDA chunked prefill cuts a step's sequences into
chunks of 64, for every sequence and for a subset (a mixed step's prompts without its one-token
decode rows, OPENINFER_QWEN35_GDN_PREFILL=split_rows)."""

from __future__ import annotations

import numpy as np
from openinfer_qwen35.gated_deltanet import chunk_layout


def test_every_sequence_cut_from_its_first_row():
    # 130 tokens (64 + 64 + 2), a decode row, 64 tokens, a decode row
    start, length, seq_chunks = chunk_layout(np.array([0, 130, 131, 195, 196]))
    np.testing.assert_array_equal(start, [0, 64, 128, 130, 131, 195])
    np.testing.assert_array_equal(length, [64, 64, 2, 1, 64, 1])
    np.testing.assert_array_equal(seq_chunks, [0, 3, 4, 5, 6])


def test_a_subset_keeps_the_rows_of_its_sequences_in_its_order():
    query_start = np.array([0, 130, 131, 195, 196])
    start, length, seq_chunks = chunk_layout(query_start, seq_ids=np.array([0, 2]))
    np.testing.assert_array_equal(start, [0, 64, 128, 131])
    np.testing.assert_array_equal(length, [64, 64, 2, 64])
    np.testing.assert_array_equal(seq_chunks, [0, 3, 4])
    # the subset of every sequence is the whole layout; an empty subset has no chunks
    for whole, part in zip(chunk_layout(query_start), chunk_layout(query_start, seq_ids=np.arange(4)), strict=True):
        np.testing.assert_array_equal(part, whole)
    start, length, seq_chunks = chunk_layout(query_start, seq_ids=np.array([], np.int64))
    assert len(start) == len(length) == 0
    np.testing.assert_array_equal(seq_chunks, [0])


def test_a_cut_starts_a_chunk_at_the_boundary():
    """A prefix-cache snapshot at a boundary inside a sequence's rows: its chunks are those of a run
    stopping at the boundary, then those of one continuing from it (the walk stores the state
    entering the first of those); no cut (0) leaves a sequence as it was."""
    query_start = np.array([0, 130, 131, 211])
    start, length, seq_chunks = chunk_layout(query_start, cuts=np.array([80, 0, 64]))
    np.testing.assert_array_equal(start, [0, 64, 80, 130, 131, 195])
    np.testing.assert_array_equal(length, [64, 16, 50, 1, 64, 16])
    np.testing.assert_array_equal(seq_chunks, [0, 3, 4, 6])
    # the chunk entering which the state is the boundary's: seq_chunks[s] + ceil(cut / 64)
    assert start[0 + 2] == 80 and start[4 + 1] == 131 + 64
    uncut = chunk_layout(query_start, cuts=np.zeros(3, np.int64))
    for got, want in zip(uncut, chunk_layout(query_start), strict=True):
        np.testing.assert_array_equal(got, want)
    start, length, seq_chunks = chunk_layout(query_start, seq_ids=np.array([2]), cuts=np.array([16]))
    np.testing.assert_array_equal(start, [131, 147])
    np.testing.assert_array_equal(length, [16, 64])
    np.testing.assert_array_equal(seq_chunks, [0, 2])
