"""Host-side attention routing (openinfer.backend.cuda.attention_routing, no CuPy): a mixed step's
leading 1-token rows split off for the decode kernel with the remaining prefill tiles as
contiguous ranges, and the short-query kernel's context threshold."""

from __future__ import annotations

import numpy as np
import pytest

from openinfer.backend.cuda.attention_routing import (
    MIXED_MIN_DECODE_ROWS,
    SHORT_QUERY_MIN_CONTEXT,
    MixedSplit,
    split_mixed_step,
    wants_short_query,
)

TILE = 128


def tiles_in_launch_order(query_start: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
    """The sequence of each 128-query tile: by start descending (as the CUDA batch orders them),
    or shuffled, since the split must not depend on the order."""
    counts = np.diff(query_start)
    seqs = np.repeat(np.arange(counts.size), -(-counts // TILE))
    starts = np.concatenate([np.arange(0, n, TILE) for n in counts])
    order = rng.permutation(seqs.size) if rng is not None else np.argsort(-starts, kind="stable")
    return seqs[order]


def query_start_of(new: list[int]) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(new))).astype(np.int32)


def check_split(new: list[int], tile_seq: np.ndarray, split: MixedSplit) -> None:
    """The ranges hold exactly the tiles of the sequences after the leading decodes, each once."""
    decode_rows = split.decode_rows
    assert all(n == 1 for n in new[:decode_rows]) and new[decode_rows] > 1
    chosen = np.concatenate([np.arange(start, stop) for start, stop in split.prefill_tile_ranges])
    assert np.array_equal(np.sort(chosen), np.flatnonzero(tile_seq >= decode_rows))
    for start, stop in split.prefill_tile_ranges:
        assert 0 <= start < stop <= tile_seq.size


def test_decodes_then_a_chunk_split_into_the_chunks_tiles():
    new = [1] * 256 + [512]
    qs = query_start_of(new)
    tile_seq = tiles_in_launch_order(qs)
    split = split_mixed_step(qs, tile_seq)
    assert split is not None and split.decode_rows == 256
    check_split(new, tile_seq, split)
    # by start descending, the chunk's tiles past its first come first, its first tile last
    assert split.prefill_tile_ranges == ((0, 3), (259, 260))


@pytest.mark.parametrize("seed", range(6))
def test_random_mixed_steps(seed):
    rng = np.random.default_rng(seed)
    decodes = int(rng.integers(MIXED_MIN_DECODE_ROWS, 40))
    new = [1] * decodes + [int(rng.integers(2, 700))] + [int(rng.integers(1, 400)) for _ in range(rng.integers(0, 5))]
    qs = query_start_of(new)
    for tile_seq in (tiles_in_launch_order(qs), tiles_in_launch_order(qs, rng)):
        split = split_mixed_step(qs, tile_seq)
        assert split is not None and split.decode_rows == decodes
        check_split(new, tile_seq, split)


@pytest.mark.parametrize("new", [
    [1, 1, 1, 1, 1],  # plain decode: the decode kernel takes the whole step anyway
    [300, 1, 1, 1, 1, 1],  # no leading decodes
    [1] * (MIXED_MIN_DECODE_ROWS - 1) + [64],  # too few to pay for a second launch
    [40],
    [],
])
def test_nothing_to_split(new):
    qs = query_start_of(new)
    tile_seq = tiles_in_launch_order(qs) if new else np.zeros(0, np.int32)
    assert split_mixed_step(qs, tile_seq) is None


def test_min_decode_rows_is_a_parameter():
    qs = query_start_of([1, 200])
    split = split_mixed_step(qs, tiles_in_launch_order(qs), min_decode_rows=1)
    assert split == MixedSplit(1, ((0, 1), (2, 3)))  # the chunk's second tile, the decode's, its first


def test_short_query_threshold():
    assert wants_short_query("auto", SHORT_QUERY_MIN_CONTEXT)
    assert not wants_short_query("auto", SHORT_QUERY_MIN_CONTEXT - 1)
    assert wants_short_query("auto", 32768) and not wants_short_query("auto", 512)
    assert wants_short_query("on", 20) and not wants_short_query("off", 32768)
    assert wants_short_query("auto", 3000, min_context=4096) is False
    assert wants_short_query("auto", None) and not wants_short_query("off", None)  # a graph, any context
    with pytest.raises(ValueError, match="short-query mode"):
        wants_short_query("1", 4096)
