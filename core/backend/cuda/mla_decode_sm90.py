"""The absorbed MLA decode's TMA-fed attention kernel (``mla_attention_tma`` in
``openinfer/kernels/mla_decode_sm90.cu``; Hopper): its tile choice, shared memory, the cache's tensor
map and the launch. ``openinfer.backend.cuda.mla`` chooses it (``OPENINFER_MLA_DECODE=tma``) and runs
the combine of its context splits.

A tile is TMA_KEYS latents of the cache, copied as 16-row boxes of 64 columns (128-byte swizzle)::

    cache [pages, block_size, (1,) lora + rope] bf16  ->  tensor map (64 columns, 1, page·block_size + slot)
    stage s of the ring:  [column block 0: keys x 128 B][column block 1] ... [column block (lora+rope)/64 - 1]
"""

from __future__ import annotations

import functools
import os

import cupy
import numpy as np

from openinfer.backend.cuda.loader import arch_kernel
from openinfer.backend.cuda.tensor_maps import BOX_ELEMENTS, TENSOR_MAP_PARAM, PageBoxLayout, encode_page_map
from openinfer.mla import MLASpec

TMA_HEADS, TMA_THREADS, TMA_WARPS = 16, 128, 4  # mla_decode_sm90.cu
TMA_BOX_ROWS = 16  # rows per TMA box: the cache block size must be a multiple
# "KEYSxSTAGES": keys per tile (16 / 32 / 64) and tiles in the ring; $OPENINFER_MLA_TMA_TILE. 32x2 holds 81 KB
# of shared memory (2 blocks per SM, the registers' limit too); 32x5 190 KB (1 block per SM, 5 tiles in flight).
# s8 E1 (H200, graph-replayed mla_forward at the 8 points of gpu_mla.py decode): the others take 1.01-1.15x 32x2's
# time with 16x4, 1.01-1.59x with 32x5 (1 block per SM), 1.00-1.10x with 16x4 and one barrier per tile
# (OPENINFER_MLA_TMA_BARRIERS=1).
TMA_TILE_ENV = "OPENINFER_MLA_TMA_TILE"
DEFAULT_TMA_TILE = (32, 2)
TMA_KEY_CHOICES = (16, 32, 64)
SM_SHARED_BYTES = 228 * 1024  # one H100 / H200 SM; each resident block also reserves 1 KB
BLOCK_SHARED_MAX = 227 * 1024
REGISTER_BLOCKS_PER_SM = 2  # 157-198 registers x 128 threads (ptxas, every tile choice): 2 blocks fit 64K
# Opt-in: $OPENINFER_MLA_TMA_CLUSTER=C (2, 4, 8 or 16; 0 / unset: off) combines a (token, head block)'s context
# splits on chip, in a cluster of up to C CTAs (distributed shared memory; no partials, no combine launch): for
# steps whose resident split count is at least 2, the largest of 16 / 8 / 4 / 2 within both C and that count
# (16 is a non-portable cluster size: the kernel is allowed it at load).
# s16 D1 (H200, Kimi-K2 layer b1 graph, results/kimi_layer_b1_s16d1_h200.json): =8 168.9 / 168.1 us vs 169.3 / 168.1
# off; its timeline: the clustered attention 15.8 us where attention + combine took 10.2 + 4.9 (+ a gap).
TMA_CLUSTER_ENV = "OPENINFER_MLA_TMA_CLUSTER"
TMA_CLUSTER_CHOICES = (16, 8, 4, 2)
# The largest cluster where $OPENINFER_MLA_TMA_CLUSTER is unset, by the step's absorbed rows: the first (most rows,
# cluster) entry whose bound holds; none (or past the last): off.
TMA_CLUSTER_BY_ROWS: tuple[tuple[int, int], ...] = ()
_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14  # CUfunction_attribute (cuda.h)
_non_portable_allowed: set[int] = set()
# $OPENINFER_MLA_TMA_BALANCE=1 (default since s8 E1) balances the splits over a ragged batch (mla_decode_sm90.cu's
# balance_slots): every step runs at least BALANCE_MIN_SPLITS splits per token, and each token takes as many
# of them as its share of the step's total context asks (one split: written whole, no combine for it). H200 s8 E1,
# contexts spread over [c/8, 2c - c/8] (results/gpu_mla_ragged_s8_e1_h200.json, graph-replayed mla_forward, us):
# 256 x mean 4k 667.9 -> 533.9, 256 x 1k 191.5 -> 171.8, 64 x 4k 199.5 -> 193.7, 64 x 1k 75.9 -> 73.1; below 132
# rows the split count is the resident one either way; =0: each context split evenly.
TMA_BALANCE_ENV = "OPENINFER_MLA_TMA_BALANCE"
BALANCE_MIN_SPLITS = 4
# Block barriers per tile ($OPENINFER_MLA_TMA_BARRIERS): 2 (default; scores exchanged, then the stage handed
# back) or 1 (two exchange buffers by tile parity, the stage of the previous tile refilled after this tile's
# barrier: mla_decode_sm90.cu TMA_ONE_BARRIER; rings of at least 2 stages).
TMA_BARRIERS_ENV = "OPENINFER_MLA_TMA_BARRIERS"
# $OPENINFER_MLA_TMA_ROW_BOXES=1 (default since s8 E1) copies 16 whole latent rows per TMA box (the map's 64-column
# blocks as its middle dimension: one 18 KB contiguous copy per 16 keys, not (lora + rope) / 64 boxes of 16 x 128
# bytes). H200 s8 E1 (results/gpu_mla_s8_e1_h200.json, 32x2 tiles, graph-replayed mla_forward, us, 1k / 4k):
# batch 64 59.6 -> 56.1 / 126.2 -> 117.9, 256 119.2 -> 109.8 / 386.5 -> 346.3 (attention 77 -> 86 % of roofline),
# batch 1 / 16 within 1 us; =0: 64-column boxes.
TMA_ROW_BOXES_ENV = "OPENINFER_MLA_TMA_ROW_BOXES"


def tma_tile() -> tuple[int, int]:
    """($OPENINFER_MLA_TMA_TILE or the default) keys per tile and ring stages; ValueError on a bad one."""
    text = os.environ.get(TMA_TILE_ENV) or "{}x{}".format(*DEFAULT_TMA_TILE)
    keys, _, stages = text.partition("x")
    if not (keys.isdigit() and stages.isdigit() and int(keys) in TMA_KEY_CHOICES and int(stages) >= 1):
        raise ValueError(f"{TMA_TILE_ENV} is KEYSxSTAGES with keys one of {TMA_KEY_CHOICES} and at least one "
                         f"stage (e.g. 32x2); got {text!r}")
    return int(keys), int(stages)


def tma_cluster(spec: MLASpec, splits: int, rows: int | None = None) -> int:
    """CTAs per cluster for a step of ``rows`` absorbed rows whose resident split count is ``splits`` (1: no cluster,
    the partials go to the combine kernel): $OPENINFER_MLA_TMA_CLUSTER, unset TMA_CLUSTER_BY_ROWS (``rows`` None: off);
    the ring must hold a CTA's fp32 partial output of 16 heads. Row count only (graph-safe)."""
    default = next((c for most, c in TMA_CLUSTER_BY_ROWS if rows <= most), 0) if rows is not None else 0
    text = os.environ.get(TMA_CLUSTER_ENV) or str(default)
    if text not in ("0", "1", *map(str, TMA_CLUSTER_CHOICES)):
        raise ValueError(f"{TMA_CLUSTER_ENV} is 0 (off) or the largest cluster, one of {TMA_CLUSTER_CHOICES}; "
                         f"got {text!r}")
    keys, stages = tma_tile()
    ring = stages * spec.latent_dim // BOX_ELEMENTS * keys * 128
    if ring < TMA_HEADS * (spec.kv_lora_rank + 2) * 4:
        return 1
    return next((c for c in TMA_CLUSTER_CHOICES if c <= min(int(text), splits)), 1)


def tma_balance() -> bool:
    """Whether the splits are balanced over a ragged batch ($OPENINFER_MLA_TMA_BALANCE, default 1; 0: off)."""
    text = os.environ.get(TMA_BALANCE_ENV) or "1"
    if text not in ("0", "1"):
        raise ValueError(f"{TMA_BALANCE_ENV} is 0 or 1; got {text!r}")
    return text == "1"


def tma_one_barrier() -> bool:
    """Whether each tile takes one block barrier ($OPENINFER_MLA_TMA_BARRIERS=1; 2 is the default)."""
    text = os.environ.get(TMA_BARRIERS_ENV) or "2"
    if text not in ("1", "2"):
        raise ValueError(f"{TMA_BARRIERS_ENV} is 1 or 2; got {text!r}")
    return text == "1"


def tma_row_boxes() -> bool:
    """Whether a TMA box holds 16 whole latent rows ($OPENINFER_MLA_TMA_ROW_BOXES, default 1; 0: 64-column boxes)."""
    text = os.environ.get(TMA_ROW_BOXES_ENV) or "1"
    if text not in ("0", "1"):
        raise ValueError(f"{TMA_ROW_BOXES_ENV} is 0 or 1; got {text!r}")
    return text == "1"


def tma_decode_smem(spec: MLASpec, keys: int, stages: int, one_barrier: bool = False, q_tile: bool = False) -> int:
    """mla_decode_sm90.cu TMA_SMEM (+ 16 bytes of static balance sums): 1 KB of alignment, the ring, the warps'
    partial scores (twice with one barrier per tile), the barriers, and with ``q_tile`` the staged query rows."""
    tile = spec.latent_dim // BOX_ELEMENTS * keys * 128
    staged = 16 + TMA_HEADS * (spec.latent_dim + 8) * 2 if q_tile else 0
    return 1024 + stages * tile + (1 + one_barrier) * TMA_WARPS * (keys // 8) * 32 * 16 + 8 * stages + staged


# Opt-in until a device A/B ($OPENINFER_MLA_TMA_Q_TILE=1): the block's 16 query rows [q_latent | q_pe] are staged in
# shared memory by 16-byte loads (9 a thread, coalesced) and each warp's A fragments taken by ldmatrix (TMA_Q_TILE),
# not 36 scattered 4-byte global loads a thread (~37 MB of L2 sectors a Moonlight b16 layer: 256 CTAs x 4,608
# loads). 18.7 KB more shared memory a block (still 2 a SM). The same fragments, the same bits. Where q's rows are
# not 16-byte aligned the plain loads run.
# s13 D3 (H200, Moonlight step b1 / b16 / b64): alone 0.958 / 0.985 / 0.990x (the staging's barrier costs more than the
# scattered loads), with the fused write 1.005 / 1.012x where the fused write alone gave 0.998 / 0.996x (there it
# replaces per-element rope loads): DEFAULT_Q_TILE_WITH_WRITE says whether the fused write's kernels stage them.
Q_TILE_ENV = "OPENINFER_MLA_TMA_Q_TILE"
DEFAULT_Q_TILE = False
DEFAULT_Q_TILE_WITH_WRITE = True


def q_tile(write: bool = False) -> bool:
    """$OPENINFER_MLA_TMA_Q_TILE (0 / 1; another value: a clear error); unset: DEFAULT_Q_TILE, or with the fused latent
    write (``write``) DEFAULT_Q_TILE_WITH_WRITE."""
    text = os.environ.get(Q_TILE_ENV)
    if text not in (None, "", "0", "1"):
        raise ValueError(f"{Q_TILE_ENV} is 0 or 1; got {text!r}")
    if text:
        return text == "1"
    return DEFAULT_Q_TILE_WITH_WRITE if write else DEFAULT_Q_TILE


def q_tile_fits(spec: MLASpec, q: cupy.ndarray, q_stride: int, q_pe_offset: int) -> bool:
    """Whether the query rows can be staged by 16-byte loads (TMA_Q_TILE): q's address, row stride, head stride and
    offset in whole 16 bytes (2-byte elements), the latent in whole 16-byte pieces per thread and one piece of the
    rope dims per thread (TMA_HEADS x rope / 8 == TMA_THREADS)."""
    return (int(q.data.ptr) % 16 == 0 and q.strides[0] % 16 == 0 and (2 * q_stride) % 16 == 0
            and (2 * q_pe_offset) % 16 == 0 and TMA_HEADS * spec.kv_lora_rank // 8 % TMA_THREADS == 0
            and TMA_HEADS * spec.qk_rope_dim // 8 == TMA_THREADS)


def tma_blocks_per_sm(smem: int) -> int:
    """Blocks of mla_attention_tma resident on one SM (shared memory and registers)."""
    return max(1, min(REGISTER_BLOCKS_PER_SM, SM_SHARED_BYTES // (smem + 1024)))


@functools.cache
def _is_hopper(device_id: int) -> bool:
    return cupy.cuda.Device(device_id).compute_capability == "90"


def tma_decode_fits(spec: MLASpec, cache: cupy.ndarray) -> bool:
    """mla_attention_tma's limits: Hopper; latent rows of whole 64-column boxes whose 16-dim score steps split
    4 ways, output quarters of 16-dim steps; a contiguous cache of 16-token multiples per block; the tile
    choice's shared memory within a block's."""
    if cache.ndim < 3 or not cache.flags.c_contiguous or cache.dtype.itemsize != 2:
        return False
    keys, stages = tma_tile()
    one_barrier = tma_one_barrier()
    block_size, latent = int(cache.shape[1]), int(cache.shape[-1])
    return (_is_hopper(cupy.cuda.Device().id) and latent == spec.latent_dim and latent % BOX_ELEMENTS == 0
            and (latent // 16) % TMA_WARPS == 0 and spec.kv_lora_rank % (16 * TMA_WARPS) == 0
            and block_size % TMA_BOX_ROWS == 0 and cache.size == cache.shape[0] * block_size * latent
            and tma_decode_smem(spec, keys, stages, one_barrier) <= BLOCK_SHARED_MAX
            and stages >= 1 + one_barrier)


_cache_maps: dict[tuple[int, PageBoxLayout], np.ndarray] = {}
CACHE_MAPS_KEPT = 1024  # a map per layer's cache (address and layout): far fewer in any model


def cache_map(cache: cupy.ndarray, row_boxes: bool = False) -> np.ndarray:
    """The tensor map of the latent cache as a kernel argument, encoded once per (address, layout): (column, 1,
    cache row) with boxes of 64 columns x 16 rows, or (``row_boxes``) (column, 64-column block, cache row) with
    boxes of 16 whole rows."""
    rows, latent = int(cache.shape[0]) * int(cache.shape[1]), int(cache.shape[-1])
    if row_boxes:
        blocks = latent // BOX_ELEMENTS
        layout = PageBoxLayout(dims=(BOX_ELEMENTS, blocks, rows), strides=(BOX_ELEMENTS * 2, latent * 2),
                               box=(BOX_ELEMENTS, blocks, TMA_BOX_ROWS))
    else:
        layout = PageBoxLayout(dims=(latent, 1, rows), strides=(latent * 2, latent * 2),
                               box=(BOX_ELEMENTS, 1, TMA_BOX_ROWS))
    key = (int(cache.data.ptr), layout)
    found = _cache_maps.get(key)
    if found is None:
        if len(_cache_maps) >= CACHE_MAPS_KEPT:
            _cache_maps.clear()
        found = _cache_maps[key] = encode_page_map(*key).view(TENSOR_MAP_PARAM)
    return found


def tma_blocks_per_sm_of(spec: MLASpec, write: bool = False) -> int:
    """Resident blocks per SM of the current tile choice (``write``: for the fused latent write's build)."""
    return tma_blocks_per_sm(tma_decode_smem(spec, *tma_tile(), tma_one_barrier(), q_tile(write)))


def tma_decode_kernel(spec: MLASpec, cluster: int = 1, write: bool = False,
                      staged_q: bool = False) -> tuple[object, int]:
    """The compiled kernel for the current tile choice and ``cluster`` (tma_cluster), and its shared memory;
    ``write``: with TMA_FUSED_WRITE (the latent write and q's rope folded in: core's $OPENINFER_MLA_FUSED_WRITE);
    ``staged_q``: with TMA_Q_TILE (``q_tile``)."""
    keys, stages = tma_tile()
    one_barrier = tma_one_barrier()
    smem = tma_decode_smem(spec, keys, stages, one_barrier, staged_q)
    attention = arch_kernel("mla_decode_sm90.cu", "mla_attention_tma", "sm_90a", smem, KV_LORA=spec.kv_lora_rank,
                            ROPE_DIM=spec.qk_rope_dim, TMA_KEYS=keys, TMA_STAGES=stages, TMA_CLUSTER=cluster,
                            TMA_ONE_BARRIER=int(one_barrier), TMA_ROW_BOXES=int(tma_row_boxes()),
                            **({"TMA_FUSED_WRITE": 1} if write else {}), **({"TMA_Q_TILE": 1} if staged_q else {}))
    ptr = getattr(attention, "ptr", None)  # None: a discover_kernels stand-in
    if cluster > 8 and ptr is not None and ptr not in _non_portable_allowed:
        cupy.cuda.driver.funcSetAttribute(ptr, _NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
        _non_portable_allowed.add(ptr)
    return attention, smem


def launch_tma_decode(attention, smem: int, grid: tuple[int, int, int], args: tuple, cache: cupy.ndarray,
                      balance_slots: int = 0, write_args: tuple = ()) -> None:
    """``mla_attention_tma`` over ``grid`` with mla_attention_mma_shared's ``args``, ``balance_slots`` (0: each
    token's context split evenly over grid z) and the cache's map; ``write_args``: the folded latent write's (kv_a,
    its row stride, norm, eps, slots, cos, sin, q's row stride), null / zero where the kernel does not write."""
    if not write_args:
        write_args = (np.uint64(0), np.int32(0), np.uint64(0), np.float32(0), np.uint64(0), np.uint64(0),
                      np.uint64(0), np.int32(0))
    attention(grid, (TMA_THREADS,), (*args, np.int32(balance_slots), *write_args, cache_map(cache, tma_row_boxes())),
              shared_mem=smem)
