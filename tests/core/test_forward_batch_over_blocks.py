"""``ForwardBatch.over_blocks``: the step a kernel test or benchmark builds by hand — positions,
write slots and query offsets follow each sequence's cached and new tokens over its block row."""

import numpy as np

from openinfer import ForwardBatch


def test_positions_slots_and_offsets_follow_the_block_rows():
    tables = np.array([[7, 3, 0], [5, 0, 0]], np.int32)
    batch = ForwardBatch.over_blocks(tables, cached=[3, 0], new=[3, 2], block_size=4, token_ids=[9, 8, 7, 6, 5])
    assert batch.positions.tolist() == [3, 4, 5, 0, 1]
    # sequence 0: position 3 in block 7, positions 4-5 in block 3; sequence 1: block 5
    assert batch.slot_mapping.tolist() == [7 * 4 + 3, 3 * 4 + 0, 3 * 4 + 1, 5 * 4 + 0, 5 * 4 + 1]
    assert batch.query_start.tolist() == [0, 3, 5]
    assert batch.context_lens.tolist() == [6, 2]
    assert batch.logits_rows.tolist() == [2, 4]
    assert (batch.max_query_len, batch.max_context_len) == (3, 6)
    assert batch.token_ids.dtype == np.int32 and batch.token_ids.tolist() == [9, 8, 7, 6, 5]
    assert not batch.is_decode


def test_a_decode_step_without_token_ids():
    batch = ForwardBatch.over_blocks(np.array([[2, 4]], np.int32), cached=[5], new=[1], block_size=4)
    assert batch.is_decode and batch.token_ids.tolist() == [0]
    assert batch.slot_mapping.tolist() == [4 * 4 + 1]
