"""Prefill-attention tiles in launch order (openinfer.backend.cuda.prefill_tiles, no CuPy): every
query in exactly one tile; the most keys first; a mixed step's leading decodes last, so the
mixed split leaves the prompt chunks' tiles as one contiguous range (one prefill launch)."""

from __future__ import annotations

import numpy as np
import pytest

from openinfer.backend.cuda.attention_routing import MIXED_MIN_DECODE_ROWS, split_mixed_step
from openinfer.backend.cuda.prefill_tiles import PREFILL_TILE, leading_single_token_run, prefill_tiles


def query_start_of(new: list[int]) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(new))).astype(np.int32)


def check_cover(new: list[int], tile_seq: np.ndarray, tile_query: np.ndarray) -> None:
    """Each sequence's new queries are covered by its tiles, each tile once, 128 apart."""
    assert tile_seq.dtype == np.int32 and tile_query.dtype == np.int32
    for seq, count in enumerate(new):
        starts = sorted(tile_query[tile_seq == seq].tolist())
        assert starts == list(range(0, count, PREFILL_TILE)), (seq, count, starts)


def test_a_plain_prefill_keeps_the_most_keys_first():
    new = [300, 40, 129]
    tile_seq, tile_query = prefill_tiles(query_start_of(new))
    check_cover(new, tile_seq, tile_query)
    # starts descending; equal starts in sequence order
    assert list(zip(tile_seq.tolist(), tile_query.tolist(), strict=True)) == [
        (0, 256), (0, 128), (2, 128), (0, 0), (1, 0), (2, 0)]


def test_decodes_then_a_chunk_give_one_contiguous_chunk_range():
    new = [1] * 256 + [512]
    qs = query_start_of(new)
    tile_seq, tile_query = prefill_tiles(qs)
    check_cover(new, tile_seq, tile_query)
    assert tile_seq[:4].tolist() == [256] * 4 and tile_query[:4].tolist() == [384, 256, 128, 0]
    assert tile_seq[4:].tolist() == list(range(256))  # the decodes, in order, last
    split = split_mixed_step(qs, tile_seq)
    assert split is not None and split.decode_rows == 256 and split.prefill_tile_ranges == ((0, 4),)


@pytest.mark.parametrize("seed", range(8))
def test_random_mixed_steps_split_into_one_prefill_range(seed):
    rng = np.random.default_rng(seed)
    decodes = int(rng.integers(MIXED_MIN_DECODE_ROWS, 60))
    # prompt chunks after the decodes, some of them a single token (they stay with the chunks)
    chunks = [int(rng.integers(2, 700))] + [int(rng.choice([1, rng.integers(2, 400)])) for _ in range(rng.integers(0, 6))]
    new = [1] * decodes + chunks
    qs = query_start_of(new)
    tile_seq, tile_query = prefill_tiles(qs)
    check_cover(new, tile_seq, tile_query)
    chunk_tiles = int(np.sum(-(-np.asarray(chunks) // PREFILL_TILE)))
    split = split_mixed_step(qs, tile_seq)
    assert split is not None and split.decode_rows == decodes
    assert split.prefill_tile_ranges == ((0, chunk_tiles),)
    # within the chunks' range: the most keys first
    assert np.all(np.diff(tile_query[:chunk_tiles]) <= 0)


def test_the_leading_run_counts_only_single_tokens_at_the_front():
    assert leading_single_token_run(np.array([1, 1, 5, 1])) == 2
    assert leading_single_token_run(np.array([1, 1, 0, 1])) == 2  # an empty sequence ends the run
    assert leading_single_token_run(np.array([3, 1])) == 0
    assert leading_single_token_run(np.array([1, 1])) == 2
    assert leading_single_token_run(np.zeros(0, np.int64)) == 0


def test_empty_steps_and_bad_input():
    tile_seq, tile_query = prefill_tiles(np.array([0], np.int32))
    assert tile_seq.size == tile_query.size == 0
    tile_seq, _ = prefill_tiles(np.array([0, 0, 5], np.int32))  # a sequence with no new token has no tile
    assert tile_seq.tolist() == [1]
    with pytest.raises(ValueError, match="decrease"):
        prefill_tiles(np.array([0, 5, 3], np.int32))
