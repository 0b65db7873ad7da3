"""The prefill-attention tiles of a step, in launch order (host arrays only, no CuPy).

A tile is ``PREFILL_TILE`` consecutive new queries of one sequence: ``(tile_seq, tile_query)``,
``tile_query`` counted from the sequence's first new token. Launch order::

    [ tiles of the other sequences, the most keys first (later query starts first) |
      tiles of the leading 1-token sequences (a mixed step's running decodes), in sequence order ]

Long key ranges start first so the kernel's tail is short tiles. The leading 1-token run goes
last because a mixed step sends exactly those rows to the decode kernel
(``attention_routing.split_mixed_step``): the prompt chunks' tiles are then the one contiguous
range ``[0, n)`` and take one prefill launch; without the split, the prefill kernel runs them all.
"""

from __future__ import annotations

import numpy as np

PREFILL_TILE = 128  # queries per prefill-attention tile (BLOCK_M of prefill_attention_sm90.cu)


def leading_single_token_run(counts: np.ndarray) -> int:
    """How many sequences at the front have exactly one new token (``counts``: new tokens per sequence)."""
    others = np.flatnonzero(np.asarray(counts) != 1)
    return int(others[0]) if others.size else int(np.asarray(counts).size)


def prefill_tiles(query_start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(tile_seq, tile_query)`` (int32) of every tile of the step whose sequences' new tokens
    start at ``query_start [B+1]``, in the launch order of the module docstring."""
    counts = np.diff(np.asarray(query_start, dtype=np.int64))
    if counts.size and counts.min() < 0:
        raise ValueError("query_start must not decrease")
    tiles_per_seq = -(-counts // PREFILL_TILE)
    seqs = np.repeat(np.arange(counts.shape[0], dtype=np.int32), tiles_per_seq)
    starts = (np.arange(seqs.size, dtype=np.int64) - np.repeat(np.cumsum(tiles_per_seq) - tiles_per_seq, tiles_per_seq)) \
        * PREFILL_TILE
    decodes_last = seqs < leading_single_token_run(counts)
    order = np.lexsort((-starts, decodes_last))  # stable: ties keep sequence order
    return seqs[order].astype(np.int32), starts[order].astype(np.int32)
