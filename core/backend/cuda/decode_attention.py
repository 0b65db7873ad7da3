"""Decode attention: one new query per sequence over its paged KV, two kernels.

``mma`` (decode_attention_mma.cu, the default): one block per (split, KV head, sequence) computes
all query heads of its GQA group on tensor cores, every warp streaming 16-key tiles through its
own cp.async pipeline; with one split it writes the output directly. Head dims 64/128/256,
groups up to 16. ``split`` (decode_attention.cu): the CUDA-core flash-decoding kernel, which
covers every other shape (head_dim 32, groups over 16) and stays selectable for comparison.
Measured on an H100 (benchmarks/results/gpu_decode_attention.json, Qwen3-4B heads): mma reads KV
at 89-103 % of the device copy bandwidth at batch 64-256 x context 512-4k, 1.5x the split kernel.

Graph capture: the split count depends only on the batch size, the KV head count and the
GPU, never on context lengths, which the kernels read from device memory; so a graph
captured for a batch-size bucket stays valid for any context up to its block-table width.

``OPENINFER_DECODE_ATTENTION=split`` selects the CUDA-core kernel everywhere (read at each call,
so a benchmark can capture one graph with each).
"""

from __future__ import annotations

import math
import os

import cupy
import numpy as np

from openinfer.backend.cuda.loader import kernel

LOG2E = 1.4426950408889634
KERNELS = ("mma", "split")
MMA_HEAD_DIMS = (64, 128, 256)
MMA_MAX_GROUP = 16  # query heads one mma row block holds
MMA_TILE_KEYS = 16
MAX_SPLITS = 32  # decode_attention_merge's MERGE_MAX_SPLITS
DEFAULT_MAX_SPLITS = 16
MMA_WARPS = 4


def mma_stages(head_dim: int) -> int:
    """Pipeline depth per warp (decode_attention_mma.cu's default DECODE_STAGES)."""
    return 3 if head_dim <= 128 else 2


def mma_shared_bytes(head_dim: int, group: int, warps: int = MMA_WARPS, stages: int | None = None) -> int:
    """Dynamic shared memory of one mma block: the warps' K/V stages, reused for the merge."""
    stages = mma_stages(head_dim) if stages is None else stages
    pipeline = warps * stages * 2 * MMA_TILE_KEYS * head_dim * 2
    merge = warps * group * (head_dim + 2) * 4
    return max(pipeline, merge)


def split_count(num_units: int, num_sms: int, max_splits: int = DEFAULT_MAX_SPLITS) -> int:
    """Splits per (sequence, KV head) unit: about two blocks per multiprocessor, at most 16.

    Measured on an H100 (benchmarks/gpu_kernel_variants.py, Qwen3-4B heads): from about one
    block per SM on, equal contexts stream near the copy bandwidth and each further split only
    adds partials and a merge (batch 64 x 1k: 95 us at 1 split, 100 at 2, 222 at 32); ragged
    contexts want the second block per SM (batch 16, lengths 1..2k: 44 us at 1 split, 36 at 2,
    34 at 8); batch 1 x 4k is fastest at 16 (12.2 us; 13.2 at 32)."""
    return max(1, min(max_splits, math.ceil(1.8 * num_sms / max(1, num_units))))


def legacy_splits(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """KV splits of the CUDA-core kernel: enough blocks for about two waves, at most 16."""
    return max(1, min(16, math.ceil(2 * num_sms / max(1, num_seqs * num_kv_heads))))


def mma_supports(head_dim: int, group: int) -> bool:
    return head_dim in MMA_HEAD_DIMS and 1 <= group <= MMA_MAX_GROUP


def choose_kernel(head_dim: int, group: int) -> str:
    """``mma`` where it applies, unless OPENINFER_DECODE_ATTENTION=split asks for the CUDA-core kernel."""
    wanted = os.environ.get("OPENINFER_DECODE_ATTENTION", "mma")
    if wanted not in KERNELS:
        raise ValueError(f"OPENINFER_DECODE_ATTENTION={wanted!r}; choose one of {KERNELS}")
    return "mma" if wanted == "mma" and mma_supports(head_dim, group) else "split"


def decode_attention_mma(q: cupy.ndarray, k_cache: cupy.ndarray, v_cache: cupy.ndarray, block_tables: cupy.ndarray,
                         context_lens: cupy.ndarray, scale: float, num_sms: int, *, warps: int = MMA_WARPS,
                         stages: int | None = None, splits: int | None = None) -> cupy.ndarray:
    """``q [B, nh, d]`` bf16 over ``k/v_cache [blocks, block_size, nkv, d]`` -> ``[B, nh * d]`` bf16.

    ``block_tables [B, W]`` and ``context_lens [B]`` are int32 device arrays; ``warps``, ``stages``
    and ``splits`` override the tuned defaults (benchmarks)."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    if not mma_supports(head_dim, group) or num_heads % num_kv_heads:
        raise ValueError(f"the mma decode kernel takes head_dim {MMA_HEAD_DIMS} and GQA groups up to "
                         f"{MMA_MAX_GROUP}, got head_dim {head_dim}, {num_heads} heads / {num_kv_heads} KV heads")
    stages = mma_stages(head_dim) if stages is None else stages
    shared = mma_shared_bytes(head_dim, group, warps, stages)
    if splits is None:
        splits = split_count(num_seqs * num_kv_heads, num_sms)
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be 1..{MAX_SPLITS}, got {splits}")
    fn = kernel("decode_attention_mma.cu", "decode_attention_mma", HEAD_DIM=head_dim, GROUP=group,
                DECODE_WARPS=warps, DECODE_STAGES=stages)
    if fn.max_dynamic_shared_size_bytes < shared:
        fn.max_dynamic_shared_size_bytes = shared
    out = cupy.empty((num_seqs, num_heads * head_dim), dtype=cupy.uint16)
    if splits == 1:
        partial_out = partial_ml = out  # unused: the kernel writes `out` itself
    else:
        partial_out = cupy.empty((num_seqs, num_heads, splits, head_dim), dtype=cupy.float32)
        partial_ml = cupy.empty((num_seqs, num_heads, splits, 2), dtype=cupy.float32)
    fn((splits, num_kv_heads, num_seqs), (warps * 32,),
       (q, k_cache, v_cache, block_tables, np.int32(block_tables.shape[1]), context_lens, out, partial_out,
        partial_ml, np.int32(num_kv_heads), np.int32(block_size), np.int32(splits), np.float32(scale * LOG2E)),
       shared_mem=shared)
    if splits > 1:
        kernel("decode_attention_mma.cu", "decode_attention_merge", HEAD_DIM=head_dim, GROUP=group)(
            (num_heads, num_seqs), (min(128, head_dim),),
            (partial_out, partial_ml, out, np.int32(num_heads), np.int32(splits)))
    return out


def decode_attention_split(q: cupy.ndarray, k_cache: cupy.ndarray, v_cache: cupy.ndarray, block_tables: cupy.ndarray,
                           context_lens: cupy.ndarray, scale: float, num_sms: int) -> cupy.ndarray:
    """The CUDA-core kernel; same arguments and result as ``decode_attention_mma``."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    splits = legacy_splits(num_seqs, num_kv_heads, num_sms)
    partial_out = cupy.empty((num_seqs, num_heads, splits, head_dim), dtype=cupy.float32)
    partial_ml = cupy.empty((num_seqs, num_heads, splits, 2), dtype=cupy.float32)
    kernel("decode_attention.cu", "decode_attention_split", HEAD_DIM=head_dim, GROUP=group)(
        (splits, num_kv_heads, num_seqs), (128,),
        (q, k_cache, v_cache, block_tables, np.int32(block_tables.shape[1]), context_lens,
         partial_out, partial_ml, np.int32(num_kv_heads), np.int32(block_size), np.int32(splits),
         np.float32(scale * LOG2E)))
    out = cupy.empty((num_seqs, num_heads * head_dim), dtype=cupy.uint16)
    kernel("decode_attention.cu", "decode_attention_combine", HEAD_DIM=head_dim, GROUP=group)(
        (num_heads, num_seqs), (min(128, head_dim),),
        (partial_out, partial_ml, out, np.int32(num_heads), np.int32(splits)))
    return out


def paged_decode_attention(q: cupy.ndarray, k_cache: cupy.ndarray, v_cache: cupy.ndarray,
                           block_tables: cupy.ndarray, context_lens: cupy.ndarray, scale: float, num_sms: int,
                           kernel_name: str | None = None) -> cupy.ndarray:
    """Decode attention with the chosen kernel (``choose_kernel`` when ``kernel_name`` is None)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    name = kernel_name or choose_kernel(head_dim, num_heads // k_cache.shape[2])
    if name not in KERNELS:
        raise ValueError(f"unknown decode attention kernel {name!r}; choose one of {KERNELS}")
    launch = decode_attention_mma if name == "mma" else decode_attention_split
    return launch(q, k_cache, v_cache, block_tables, context_lens, scale, num_sms)
