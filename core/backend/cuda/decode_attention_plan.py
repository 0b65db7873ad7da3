"""Launch plans of decode_attention.py's kernels, host-only (no CuPy: CPU CI checks them and
benchmarks dry-run them): their constants, split counts, shared-memory sizes, and the short-query
kernel's layout choice (``short_query_launch``), from host counts alone, so a CUDA graph captured
for a batch bucket keeps its plan at any context length."""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

LOG2E = 1.4426950408889634
MMA_HEAD_DIMS = (64, 128, 256)
MMA_MAX_GROUP = 16  # query heads one mma row block holds
MMA_TILE_KEYS = 16
MMA_ROWS = 16  # rows of one mma row block: query heads (decode) or (token, head) pairs (short queries)
SHORT_QUERY_MAX_TOKENS = 16  # new tokens per sequence the short-query kernel takes (one KV block)
MAX_SPLITS = 32  # decode_attention_merge's MERGE_MAX_SPLITS
DEFAULT_MAX_SPLITS = 16
MMA_WARPS = 4
SHORT_QUERY_TILES = ("warp", "shared")
SHORT_QUERY_TILES_ENV = "OPENINFER_SHORT_QUERY_TILES"
# "shared": E1 (H200, 16 new tokens, Qwen3-4B heads, per layer, kernel + merge) against "warp":
# batch 1 at 32 splits 0.95x / 1.14x / 1.34x / 1.40x at 1k / 4k / 16k / 32k of context (12.9 vs
# 12.2 us ... 44.7 vs 60.0 us at 16k), batch 4 1.20x-1.46x; the whole Qwen3-4B short-prefill graph
# step of a 16-token tail at 16k 5.37 -> 5.02 ms (30 splits then; 1k / 4k 0.98x).
SHORT_QUERY_TILES_DEFAULT = "shared"
SHARED_TILE_WARPS = 4  # short_query_attention_shared: one warp per 16-row mma block
SHARED_TILE_STAGES = 3  # its cp.async ring (SQ_STAGES)


def shared_tile_keys(head_dim: int) -> int:
    """Keys of one of short_query_attention_shared's K/V tiles (SQ_TILE_KEYS)."""
    return 64 if head_dim <= 128 else 32


def shared_tile_bytes(head_dim: int) -> int:
    """short_query_attention_shared's dynamic shared memory: SQ_STAGES K + V tiles, bf16."""
    return SHARED_TILE_STAGES * 2 * shared_tile_keys(head_dim) * head_dim * 2


SHORT_QUERY_SOFTMAX_ENV = "OPENINFER_SHORT_QUERY_SOFTMAX"  # "tile" (the default) or "subtile"
# "tile": E2 (H200, merged main 446deb4, 16 new tokens, Qwen3-4B heads) against "subtile", per layer
# at batch 1: 12.4 vs 13.6 us at 1k, 17.1 vs 19.1 at 4k, 37.2 vs 44.9 at 16k, 62.6 vs 78.5 at 32k
# (batch 4: 1.12-1.31x); the short-prefill graph step of a 16-token tail 3.745 / 3.894 / 4.589 ms
# vs 3.771 / 3.970 / 4.877 at 1k / 4k / 16k (the "warp" layout: 3.702 / 4.009 / 5.382)
SHORT_QUERY_SOFTMAX_DEFAULT = "tile"


@functools.cache
def wanted_tile_softmax() -> bool:
    """OPENINFER_SHORT_QUERY_SOFTMAX="tile" (the default): the shared-tile kernel updates its
    softmax once per 64-key tile (SQ_TILE_SOFTMAX=1; head_dim <= 128) instead of per 16 keys
    ("subtile"). Read once per process (``wanted_tile_softmax.cache_clear()`` re-reads it)."""
    wanted = os.environ.get(SHORT_QUERY_SOFTMAX_ENV, SHORT_QUERY_SOFTMAX_DEFAULT)
    if wanted not in ("subtile", "tile"):
        raise ValueError(f"{SHORT_QUERY_SOFTMAX_ENV}={wanted!r}; choose 'subtile' or 'tile'")
    return wanted == "tile"


@functools.cache
def wanted_short_query_tiles() -> str:
    """OPENINFER_SHORT_QUERY_TILES ("warp" or "shared"), read once per process
    (``wanted_short_query_tiles.cache_clear()`` re-reads it)."""
    wanted = os.environ.get(SHORT_QUERY_TILES_ENV, SHORT_QUERY_TILES_DEFAULT)
    if wanted not in SHORT_QUERY_TILES:
        raise ValueError(f"{SHORT_QUERY_TILES_ENV}={wanted!r}; choose one of {SHORT_QUERY_TILES}")
    return wanted


def mma_stages(head_dim: int) -> int:
    """Pipeline depth per warp (decode_attention_mma.cu's default DECODE_STAGES)."""
    return 3 if head_dim <= 128 else 2


def mma_shared_bytes(head_dim: int, rows: int, warps: int = MMA_WARPS, stages: int | None = None) -> int:
    """Dynamic shared memory of one mma block: the warps' K/V stages, reused for the merge of
    its ``rows`` query rows (the group's heads; for short queries, ``short_query_rows``)."""
    stages = mma_stages(head_dim) if stages is None else stages
    pipeline = warps * stages * 2 * MMA_TILE_KEYS * head_dim * 2
    merge = warps * rows * (head_dim + 2) * 4
    return max(pipeline, merge)


def short_query_tokens_per_block(group: int) -> int:
    """New tokens one short-query block computes: its 16 mma rows hold that many tokens' heads."""
    return MMA_ROWS // group


def split_count(num_units: int, num_sms: int, max_splits: int = DEFAULT_MAX_SPLITS) -> int:
    """Splits per (sequence, KV head) unit: about two blocks per multiprocessor, at most 16.

    Measured on an H100 (benchmarks/gpu_kernel_variants.py, Qwen3-4B heads): from about one
    block per SM on, equal contexts stream near the copy bandwidth and each further split only
    adds partials and a merge (batch 64 x 1k: 95 us at 1 split, 100 at 2, 222 at 32); ragged
    contexts want the second block per SM (batch 16, lengths 1..2k: 44 us at 1 split, 36 at 2,
    34 at 8); batch 1 x 4k is fastest at 16 (12.2 us; 13.2 at 32)."""
    return max(1, min(max_splits, math.ceil(1.8 * num_sms / max(1, num_units))))


def shared_split_count(num_units: int, num_sms: int) -> int:
    """Splits of the shared-tile short-query kernel per (sequence, KV head, row group) unit: the
    largest power of two up to two blocks per SM, at most MAX_SPLITS (a power of two divides a
    context's 64-key tiles evenly, so no split runs a tile more than the others). E1 (H200, 16
    new tokens, Qwen3-4B heads, per layer): batch 1 at 32 splits 12.9 / 18.9 / 44.7 / 78.7 us at
    1k / 4k / 16k / 32k of context (30 splits: 13.5 / 22.2 / 49.5 / 87.8; 16: 10.8 / 20.9 / 64.1
    / 119.5); batch 4 at 8 splits 18.7 / 44.5 / 145.9 / 278.5 us (16: 24.0 / 49.5 / 151.3 / 284.0)."""
    most = max(1, min(MAX_SPLITS, (2 * num_sms) // max(1, num_units)))
    return 1 << (most.bit_length() - 1)


def legacy_splits(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """KV splits of the CUDA-core kernel: enough blocks for about two waves, at most 16."""
    return max(1, min(16, math.ceil(2 * num_sms / max(1, num_seqs * num_kv_heads))))


def mma_supports(head_dim: int, group: int) -> bool:
    return head_dim in MMA_HEAD_DIMS and 1 <= group <= MMA_MAX_GROUP


@dataclass(frozen=True)
class ShortQueryLaunch:
    """One short-query launch: ``kernel`` (a decode_attention_mma.cu entry) over a grid of
    ``(splits * row_blocks_arg, num_kv_heads, num_seqs)`` blocks of ``threads``, ``shared_bytes``
    of dynamic shared memory; ``row_blocks_arg`` is the kernel's row_blocks / row_groups argument;
    ``row_blocks`` the blocks per (split, KV head, sequence), each reading its keys once."""

    kernel: str
    splits: int
    row_blocks_arg: int
    threads: int
    shared_bytes: int

    @property
    def row_blocks(self) -> int:
        return self.row_blocks_arg

    def grid(self, num_seqs: int, num_kv_heads: int) -> tuple[int, int, int]:
        return (self.splits * self.row_blocks_arg, num_kv_heads, num_seqs)


def short_query_launch(tiles: str, num_seqs: int, num_kv_heads: int, group: int, head_dim: int,
                       max_query_len: int, num_sms: int, splits: int | None = None) -> ShortQueryLaunch:
    """The launch of ``max_query_len`` new tokens per sequence in layout ``tiles``: "warp" (one
    16-row block per row block, 16 // group tokens each, up to 16 splits) or "shared" (a block per
    four row blocks sharing its K/V tiles, ``shared_split_count``: at batch 1 its 8 KV heads take
    32 splits, two blocks on each of an H200's 132 SMs). Rows that fit one 16-row block always take "warp":
    it reads the keys once already. ``splits`` overrides the tuned count."""
    if tiles not in SHORT_QUERY_TILES:
        raise ValueError(f"short-query tiles must be one of {SHORT_QUERY_TILES}, got {tiles!r}")
    row_blocks = math.ceil(max_query_len / short_query_tokens_per_block(group))
    if tiles == "shared" and row_blocks > 1:
        row_groups = math.ceil(row_blocks / SHARED_TILE_WARPS)
        if splits is None:
            splits = shared_split_count(num_seqs * num_kv_heads * row_groups, num_sms)
        return ShortQueryLaunch("short_query_attention_shared", splits, row_groups, SHARED_TILE_WARPS * 32,
                                shared_tile_bytes(head_dim))
    if splits is None:
        splits = split_count(num_seqs * num_kv_heads * row_blocks, num_sms)
    return ShortQueryLaunch("short_query_attention_mma", splits, row_blocks, MMA_WARPS * 32,
                            mma_shared_bytes(head_dim, short_query_tokens_per_block(group) * group))
