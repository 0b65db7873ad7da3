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

``short_query_attention_mma``: the mma kernel's blocks for a few new tokens per sequence (up to
``SHORT_QUERY_MAX_TOKENS``, each token with its causal limit), rows = 16 // group tokens x group
heads, split over the keys like decode: a warm prefix's last block or a short chunk over a long
cached context, where prefill's 128-query tiles would run mostly empty rows on few blocks. Two
layouts (``SHORT_QUERY_TILES``): "warp" (decode_attention_mma.cu's short_query_attention_mma: a
block per 16 rows, its warps taking 16-key tiles round-robin, so the keys are read once per 16
rows) and "shared" (short_query_attention_shared: a block per 64 rows, one warp per 16, all four
running over each 64-key tile the block copies once, with up to 32 splits to fill the GPU at
batch 1). ``OPENINFER_SHORT_QUERY_TILES`` ("shared", the default, or "warp") picks it; a step
whose rows fit one 16-row block always takes "warp" (it reads the keys once already).

Every entry point takes ``out=``: a C-contiguous ``[rows, num_heads * head_dim]`` bf16 array
(e.g. the first rows of a mixed step's output) written in place instead of a new one.

``OPENINFER_DECODE_ATTENTION=split`` selects the CUDA-core kernel everywhere (read once per
process; ``openinfer.backend.cuda.kernel_choices.refresh_kernel_choices()`` re-reads it, so a
benchmark can capture one graph with each).
"""

from __future__ import annotations

import cupy
import numpy as np

from openinfer.backend.cuda.decode_attention_plan import (
    LOG2E,
    MAX_SPLITS,
    MMA_HEAD_DIMS,
    MMA_MAX_GROUP,
    MMA_WARPS,
    SHORT_QUERY_MAX_TOKENS,
    legacy_splits,
    mma_shared_bytes,
    mma_stages,
    mma_supports,
    short_query_launch,
    split_count,
    wanted_short_query_tiles,
    wanted_tile_softmax,
)
from openinfer.backend.cuda.kernel_choices import DECODE_KERNELS, wanted_decode_kernel
from openinfer.backend.cuda.loader import kernel

KERNELS = DECODE_KERNELS


def choose_kernel(head_dim: int, group: int) -> str:
    """``mma`` where it applies, unless OPENINFER_DECODE_ATTENTION=split asks for the CUDA-core kernel."""
    return "mma" if wanted_decode_kernel() == "mma" and mma_supports(head_dim, group) else "split"


def decode_attention_mma(q: cupy.ndarray, k_cache: cupy.ndarray, v_cache: cupy.ndarray, block_tables: cupy.ndarray,
                         context_lens: cupy.ndarray, scale: float, num_sms: int, *, warps: int = MMA_WARPS,
                         stages: int | None = None, splits: int | None = None,
                         out: cupy.ndarray | None = None) -> cupy.ndarray:
    """``q [B, nh, d]`` bf16 over ``k/v_cache [blocks, block_size, nkv, d]`` -> ``[B, nh * d]`` bf16.

    ``block_tables [B, W]`` and ``context_lens [B]`` are int32 device arrays; ``warps``, ``stages``
    and ``splits`` override the tuned defaults (benchmarks); ``out`` is written and returned if given."""
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
    out = output_rows(out, num_seqs, num_heads, head_dim)
    fn = kernel("decode_attention_mma.cu", "decode_attention_mma", HEAD_DIM=head_dim, GROUP=group,
                DECODE_WARPS=warps, DECODE_STAGES=stages)
    if fn.max_dynamic_shared_size_bytes < shared:
        fn.max_dynamic_shared_size_bytes = shared
    partial_out, partial_ml = _partials(out, num_heads, head_dim, splits)
    fn((splits, num_kv_heads, num_seqs), (warps * 32,),
       (q, k_cache, v_cache, block_tables, np.int32(block_tables.shape[1]), context_lens, out, partial_out,
        partial_ml, np.int32(num_kv_heads), np.int32(block_size), np.int32(splits), np.float32(scale * LOG2E)),
       shared_mem=shared)
    merge_splits(partial_out, partial_ml, out, num_heads, head_dim, group, splits, warps, stages)
    return out


def output_rows(out: cupy.ndarray | None, num_rows: int, num_heads: int, head_dim: int) -> cupy.ndarray:
    """``out`` checked as what a kernel here writes, ``[num_rows, num_heads * head_dim]`` bf16 and
    C-contiguous (the kernels address row r at ``r * num_heads * head_dim``), or a new such array."""
    shape = (num_rows, num_heads * head_dim)
    if out is None:
        return cupy.empty(shape, dtype=cupy.uint16)
    if not isinstance(out, cupy.ndarray) or out.dtype != cupy.uint16 or tuple(out.shape) != shape \
            or not out.flags.c_contiguous:
        got = f"{type(out).__name__} {tuple(getattr(out, 'shape', ()))} {getattr(out, 'dtype', '')}"
        if isinstance(out, cupy.ndarray) and not out.flags.c_contiguous:
            got += " (strided)"
        raise ValueError(f"out must be a C-contiguous bf16 (uint16) CuPy array of shape {shape}, got {got}")
    return out


def _partials(out: cupy.ndarray, num_heads: int, head_dim: int, splits: int) -> tuple[cupy.ndarray, cupy.ndarray]:
    """Per-split partials ``[rows, num_heads, splits, head_dim]`` and ``[rows, num_heads, splits, 2]``
    for the rows of ``out``; with one split the kernel writes ``out`` itself and they go unused."""
    if splits == 1:
        return out, out
    return (cupy.empty((out.shape[0], num_heads, splits, head_dim), dtype=cupy.float32),
            cupy.empty((out.shape[0], num_heads, splits, 2), dtype=cupy.float32))


def merge_splits(partial_out: cupy.ndarray, partial_ml: cupy.ndarray, out: cupy.ndarray, num_heads: int,
                 head_dim: int, group: int, splits: int, warps: int = MMA_WARPS, stages: int | None = None) -> None:
    """``out`` = the splits' partials merged (nothing to do with one split). The merge kernel takes the
    defines of the decode kernel that wrote the partials (``warps``, ``stages``; it uses neither), so
    decode_attention_mma.cu compiles once, not once more for the merge (a whole extra NVRTC build of the
    file: 1.6-3.0 s of a fresh machine's start, s9 D1b)."""
    if splits > 1:
        kernel("decode_attention_mma.cu", "decode_attention_merge", HEAD_DIM=head_dim, GROUP=group,
               DECODE_WARPS=warps, DECODE_STAGES=mma_stages(head_dim) if stages is None else stages)(
            (num_heads, out.shape[0]), (min(128, head_dim),),
            (partial_out, partial_ml, out, np.int32(num_heads), np.int32(splits)))


def short_query_attention_mma(q: cupy.ndarray, k_cache: cupy.ndarray, v_cache: cupy.ndarray,
                              block_tables: cupy.ndarray, context_lens: cupy.ndarray, query_start: cupy.ndarray,
                              max_query_len: int, scale: float, num_sms: int, *, splits: int | None = None,
                              tiles: str | None = None, out: cupy.ndarray | None = None) -> cupy.ndarray:
    """Causal attention of a few new tokens per sequence, ``q [T, nh, d]`` -> ``[T, nh * d]`` bf16.

    ``query_start [B + 1]`` (int32, device) gives each sequence's rows of ``q``; its new tokens are
    the last ``query_len`` positions of ``context_lens`` (their K/V already in the cache), at most
    ``max_query_len`` (<= SHORT_QUERY_MAX_TOKENS) each. ``tiles`` ("warp" | "shared"; None: the
    OPENINFER_SHORT_QUERY_TILES default) picks the layout, ``splits`` overrides the tuned split
    count; ``out`` is written and returned if given."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    num_seqs = context_lens.shape[0]
    group = num_heads // num_kv_heads
    if not mma_supports(head_dim, group) or num_heads % num_kv_heads:
        raise ValueError(f"the short-query kernel takes head_dim {MMA_HEAD_DIMS} and GQA groups up to "
                         f"{MMA_MAX_GROUP}, got head_dim {head_dim}, {num_heads} heads / {num_kv_heads} KV heads")
    if not 1 <= max_query_len <= SHORT_QUERY_MAX_TOKENS:
        raise ValueError(f"the short-query kernel takes 1..{SHORT_QUERY_MAX_TOKENS} new tokens per sequence, "
                         f"got {max_query_len}")
    if splits is not None and not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be 1..{MAX_SPLITS}, got {splits}")
    plan = short_query_launch(wanted_short_query_tiles() if tiles is None else tiles, num_seqs, num_kv_heads, group,
                              head_dim, max_query_len, num_sms, splits)
    out = output_rows(out, num_tokens, num_heads, head_dim)
    # both entries in one module (the "warp" kernel's defines; the opt-in whole-tile softmax its own)
    tile_softmax = {"SQ_TILE_SOFTMAX": 1} if plan.kernel == "short_query_attention_shared" and wanted_tile_softmax() \
        else {}
    fn = kernel("decode_attention_mma.cu", plan.kernel, HEAD_DIM=head_dim, GROUP=group, DECODE_WARPS=MMA_WARPS,
                DECODE_STAGES=mma_stages(head_dim), **tile_softmax)
    if fn.max_dynamic_shared_size_bytes < plan.shared_bytes:
        fn.max_dynamic_shared_size_bytes = plan.shared_bytes
    splits = plan.splits
    partial_out, partial_ml = _partials(out, num_heads, head_dim, splits)
    fn(plan.grid(num_seqs, num_kv_heads), (plan.threads,),
       (q, k_cache, v_cache, block_tables, np.int32(block_tables.shape[1]), context_lens, query_start,
        np.int32(plan.row_blocks_arg), out, partial_out, partial_ml, np.int32(num_kv_heads), np.int32(block_size),
        np.int32(splits), np.float32(scale * LOG2E)), shared_mem=plan.shared_bytes)
    merge_splits(partial_out, partial_ml, out, num_heads, head_dim, group, splits)
    return out


def decode_attention_split(q: cupy.ndarray, k_cache: cupy.ndarray, v_cache: cupy.ndarray, block_tables: cupy.ndarray,
                           context_lens: cupy.ndarray, scale: float, num_sms: int, *,
                           out: cupy.ndarray | None = None) -> cupy.ndarray:
    """The CUDA-core kernel; same arguments and result as ``decode_attention_mma``."""
    num_seqs, num_heads, head_dim = q.shape
    out = output_rows(out, num_seqs, num_heads, head_dim)
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
    kernel("decode_attention.cu", "decode_attention_combine", HEAD_DIM=head_dim, GROUP=group)(
        (num_heads, num_seqs), (min(128, head_dim),),
        (partial_out, partial_ml, out, np.int32(num_heads), np.int32(splits)))
    return out


def paged_decode_attention(q: cupy.ndarray, k_cache: cupy.ndarray, v_cache: cupy.ndarray,
                           block_tables: cupy.ndarray, context_lens: cupy.ndarray, scale: float, num_sms: int,
                           kernel_name: str | None = None, *, out: cupy.ndarray | None = None) -> cupy.ndarray:
    """Decode attention with the chosen kernel (``choose_kernel`` when ``kernel_name`` is None),
    into ``out`` when given (see ``output_rows``)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    name = kernel_name or choose_kernel(head_dim, num_heads // k_cache.shape[2])
    if name not in KERNELS:
        raise ValueError(f"unknown decode attention kernel {name!r}; choose one of {KERNELS}")
    launch = decode_attention_mma if name == "mma" else decode_attention_split
    return launch(q, k_cache, v_cache, block_tables, context_lens, scale, num_sms, out=out)
