"""Multi-head latent attention on the GPU, absorbed form, over the paged latent cache
(kernels in ``openinfer/kernels/mla.cu`` and, for Hopper's decompressed prefill, ``mla_prefill_sm90.cu``; the
NumPy reference is ``openinfer.mla``).

One step, T new tokens, H heads::

    mla_write_latent   rms(c_kv)·w | rope(k_pe) → cache[slot];  rope(q_pe) in place
    W_UK (batched)     q_latent[t, h] = q_nope[t, h] · W_UK[h]             [T, H, lora]
    mla_attention      o_latent[t, h] = softmax(q̃·c_kv + q_pe·k_pe) · c_kv  over positions ≤ t
    W_UV (batched)     o[t, h]        = W_UV[h] · o_latent[t, h]          [T, H·v]

With ``OPENINFER_MLA_FUSED_WRITE`` a decode step (one new token per sequence) runs three launches: W_UK over q
where the projection wrote it, ``mla_attention_tma`` computing each token's latent row itself (stored by head block 0,
patched into its own tile) and rotating q_pe as it loads it, then W_UV (and the split combine where the splits are
not combined in the kernel; with ``OPENINFER_MLA_COMBINE_EXPAND`` the combine and W_UV are one launch,
``mla_combine_expand``). ``attend_and_expand`` runs every absorbed step after W_UK.

Sequences that bring at least ``PREFILL_MIN_QUERY`` new tokens (prompts, prefill chunks) take the
decompressed form instead, where tensor cores pay for expanding the latents::

    mla_gather_context   the chunk's context latents → c_kv [C, lora], k_pe [C, rope]
    kv_b (cuBLAS)        k_nope = c_kv · W_UK^T [C, H·nope], values = c_kv · W_UV^T [C, H·v]
    mla_prefill_attention_*  causal flash attention, K = [k_nope | k_pe] (nope + rope), V, per head
                           (prefill_kernel: wgmma on Hopper, else pipelined mma.sync)

The rest of the step (decodes, short chunks) keeps the absorbed form over its own token rows.
Decode-only steps (and CUDA graphs, whose static batches carry no host copy) never look at the
host arrays.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import cupy
import numpy as np

from openinfer.backend.base import ForwardBatch
from openinfer.backend.cuda import mla_decode_sm90
from openinfer.backend.cuda.cublas import Cublas
from openinfer.backend.cuda.loader import arch_kernel, kernel
from openinfer.backend.cuda.tensor_maps import BOX_ELEMENTS, TENSOR_MAP_PARAM, PageBoxLayout, encode_page_map
from openinfer.mla import MLASpec, decompressed_prefill_layout

HEADS_PER_BLOCK = 16  # mla.cu
MLA_THREADS = 256
# mla_attention_mma (absorbed form on tensor cores): 64 heads x a quarter of the latent dims per block
MMA_DECODE_HEADS, MMA_DECODE_KEYS, MMA_DECODE_PARTS, MMA_DECODE_THREADS = 64, 32, 4, 128
# The absorbed form's attention kernel: "cuda_cores" (mla_attention), "mma" (mla_attention_mma,
# tensor cores, 64 heads per block, or 16 under $OPENINFER_MLA_HEADS16=1), "mma16" (mla_attention_mma
# in blocks of 16 heads, a warp per output quarter) or "mma_shared" (mla_attention_mma_shared: 16-head
# blocks scoring each key once, double-buffered tiles) or "tma" (mla_attention_tma, mla_decode_sm90.cu: Hopper,
# 16-head blocks fed by a TMA ring, the score dims split over the warps; opt-in, off Hopper mma_shared runs).
# Chosen in one place, ``choose_absorbed_kernel``:
# a kernel forced by the caller or by $OPENINFER_MLA_DECODE, else the first entry of
# ABSORBED_KERNEL_CHOICE (most heads, most absorbed rows in the step, kernel) that holds, else
# DEFAULT_ABSORBED_KERNEL.
ABSORBED_KERNELS = ("cuda_cores", "mma", "mma16", "mma_shared", "tma")
ABSORBED_KERNEL_ENV = "OPENINFER_MLA_DECODE"
DEFAULT_ABSORBED_KERNEL = "cuda_cores"  # past the table: more than 64 heads per GPU is not measured yet
# H100, benchmarks/gpu_kimi.py, 2026-11-23 window W2 (whole mla_forward, context 1024 unless said):
# 16 heads: mma 0.132 vs 0.226 ms at batch 1 (0.181 vs 0.478 at context 4096), 0.555 vs 0.634 at 64,
# 1.78 vs 1.66 at 256 (behind); 64 heads, W3a: 0.188 vs 0.271 ms at batch 1 (0.240 vs 0.538 at
# context 4096), 0.590 vs 1.705 at 64 (1.69 vs 6.48 at context 4096), 1.94 vs 6.28 at 256.
# H200 E3 (2026-11-24, results/kimi_kernels_mla_decode_e3_h200.json), with the async tiles below: 16 heads
# mma 0.148 vs CUDA cores 0.176 ms at batch 1, 0.309 vs 0.730 at 64, 0.814 vs 1.652 at 256: mma throughout;
# in 16-head blocks (mma16) 0.206 at batch 1 (behind), 0.173 at 64 and 0.282 at 256.
# H200 E1 (2026-11-24, benchmarks/gpu_mla.py, results/gpu_mla_e1_h200.json; Moonlight's 16 heads, 16-token
# cache blocks; graph-replayed mla_forward, ms, context 1k / 4k): mma_shared vs the defaults before it
# (mma below 64 rows, mma16 from 64): batch 1 0.0303 vs 0.0303 / 0.0383 vs 0.0461, 16 0.0349 vs 0.0855 /
# 0.0635 vs 0.2852, 64 0.0636 vs 0.0791 / 0.150 vs 0.212, 256 0.143 vs 0.190 / 0.480 vs 0.598 (the
# attention kernel alone at 256: 55 % / 61 % of the latent bytes over the copy rate): mma_shared throughout.
# s8 E1 (H200, 2026-11-24, results/gpu_mla_s8_e1_h200.json; same table, graph-replayed mla_forward, us, 1k / 4k):
# "tma" (mla_attention_tma with whole-row boxes, now its defaults) vs mma_shared: batch 1 23.9 vs 23.0 (behind) /
# 27.6 vs 30.0, 16 31.7 vs 32.0 / 54.0 vs 57.6, 64 56.1 vs 61.6 / 117.9 vs 140.9, 256 109.8 vs 135.4 / 346.3 vs
# 445.8 (attention kernel alone at 256 x 4k: 86 % of the latent bytes over the copy rate, was 66 %); ragged
# contexts (results/gpu_mla_ragged_s8_e1_h200.json, balanced splits) 256 x 4k 533.9 vs 778.4: tma from 2 rows.
# Opt-in for s8's last hours (E2's Moonlight fault), cleared by s9 D1's bisect (the fault was the MoE decode
# routing, since deleted); Moonlight bursts with it (s9 D1b, results/moonlight_bisect_tma*_s9d1b_h200.json):
# TPOT 2.97 / 8.80 / 12.69 ms and 7,027 tok/s at 1 / 16 / 64 / 256 streams vs 2.94 / 8.82 / 12.76 and 6,947.
# s10 D2 (H200, results/mla13c_h64_s10d2.json, gpu_mla.py decode --decode-heads 64, graph-replayed mla_forward, 1k
# context): tma vs mma at 64 heads 28.1 vs 30.5 us at batch 1, 56.4 vs 98.5 at 16, 120.5 vs 226.2 at 64 (1.08 /
# 1.75 / 1.88x): tma for 17-64 heads too (off Hopper mma runs, as before).
ABSORBED_KERNEL_CHOICE: tuple[tuple[int, int, str], ...] = ((16, 1, "mma_shared"), (16, 1 << 30, "tma"),
                                                            (64, 1 << 30, "tma"))
# Context splits of the absorbed kernels at most (about two waves of blocks; a batch-1 step of 64 heads
# at 1k context: 33 non-empty splits x 4 latent quarters = 132 blocks, at 16 it was 11 x 4). H200,
# window D3 of 2026-11-23: attention 66.3 -> 61.6 us at batch 1 (with the spread rope below); 64 /
# 256 tokens split 2 / 1 ways either way. $OPENINFER_MLA_MAX_SPLITS lowers it.
MAX_SPLITS = 64
MAX_SPLITS_ENV = "OPENINFER_MLA_MAX_SPLITS"
# mla_write_latent's q_pe rotation over a block per 128 head pairs (default; one block rotated 64 heads
# in 16 dependent in-place rounds): 12.3 -> 6.7 / 13.4 -> 6.9 / 13.4 -> 6.9 us at batch 1 / 64 / 256
# (H200, D3). $OPENINFER_MLA_SPREAD_ROPE=0: one block per token.
SPREAD_ROPE_ENV = "OPENINFER_MLA_SPREAD_ROPE"
# Opt-in: $OPENINFER_MLA_WRITE_ABSORB=1 runs mla_write_latent and W_UK as one kernel (mla_write_absorb) in decode
# steps of at most WRITE_ABSORB_MAX_TOKENS rows: one launch instead of the latent write and cuBLAS's batched GEMM.
# s8 E1 (H200): its first form (scalar W_UK loads, 8 in flight) took 12.3 us at batch 1 where the two launches take
# 7.7 (3.8 + 3.9): each thread now loads its W_UK rows as 16-byte vectors, all in flight at once.
WRITE_ABSORB_ENV = "OPENINFER_MLA_WRITE_ABSORB"
# Default since s13 D3: $OPENINFER_MLA_Q_VIEW (1) leaves q where the projection wrote it (Moonlight: a row view of the
# fused q / kv_a output) in absorbed steps: the latent write stores every head's rotated q_pe into a small [T, H, rope]
# buffer of its own (mla_write_latent_q_pe), W_UK reads q's nope dims through its row stride, and the attention kernels
# read that q_pe buffer (q_stride rope, offset 0). No copy of q (a cupy_copy__uint16_uint16 of 1.5 / 2.2 us a layer at
# Moonlight b16 / b64) and no in-place rotation: the same values, the same bits (logits equal in every A/B). H200,
# Moonlight decode graphs, gpu_step_timeline.py, b16 / b64 step vs the copy: s13 early D1 1.007 / 1.007x
# (timeline_moonlight_mla13_d1.json), D3 1.010 / 1.009x (timeline_moonlight_mla13_d3.json; b1 within noise: one row
# needs no copy). =0: the copy.
Q_VIEW_ENV = "OPENINFER_MLA_Q_VIEW"
DEFAULT_Q_VIEW = True
# Default since s13 D3b: $OPENINFER_MLA_FUSED_WRITE (1) folds mla_write_latent into mla_attention_tma in steps of
# one new token per sequence (decode steps and their graphs): the split that holds a token's own position computes
# its latent row (the write kernel's sums), head block 0 stores it, the tile holding that position takes it from
# shared memory, and every CTA rotates q's rope dims as it loads them from the projection's rows (q read in place, as
# Q_VIEW; W_UK strided). The splits cut the cached keys and the last one adds the own row (alone in its tile where the
# cached keys fill whole tiles: no copy for it): Moonlight b16's 1,025-key contexts run 16 splits of 64 keys (2 tiles,
# both in flight from the start) instead of 11 of 96 (3 tiles, the third behind a refill); Kimi b1 32 of 32 instead
# of 17 of 64. One launch fewer a layer (s12 D1, Moonlight b16: the latent write took 4.0 us a layer); with one split
# the same bits, with more the same sums over other split bounds. Other kernels (off Hopper, the step's choice) take
# mla_write_latent_q_pe first. Its query rows are staged in shared memory (mla_decode_sm90.DEFAULT_Q_TILE_WITH_WRITE).
# H200, Moonlight decode graphs (gpu_step_timeline.py) vs Q_VIEW alone: s13 D3 (one process, 2 rounds) b16 / b64
# 1.005 / 1.012x vs the copy; D3b (3 rounds, timeline_moonlight_mla13_d3b.json) 1.006 / 1.002x vs Q_VIEW, b1 0.998x
# (b1 runs mma_shared: the same kernels, W_UK launched first). Kimi-K2 layer b1 (D3): 189.2 -> 187.8 us. Trace (D3,
# b16): attention 17.0 us with the write folded in (16.7 + write 3.9 + copy 1.6 before). =0: the separate write.
FUSED_WRITE_ENV = "OPENINFER_MLA_FUSED_WRITE"
DEFAULT_FUSED_WRITE = True
FUSED_WRITE_MIN_ROWS = 1  # the default's fewest rows (the switch set to 1 takes every decode step)
WRITE_ABSORB_MAX_TOKENS = 16  # mla.cu ABSORB_MAX_TOKENS (each thread's accumulators: 16 rows x 8 columns)
WRITE_ABSORB_COLUMNS, WRITE_ABSORB_THREADS = 64, 128
# Opt-in until a device A/B: $OPENINFER_MLA_ABSORB_SMALL=1 runs W_UK as mla_absorb_small (mla_write_absorb's blocks
# without the write: each thread's W_UK rows as 16-byte vectors all in flight) instead of cuBLAS's batched GEMM
# in steps of at most WRITE_ABSORB_MAX_TOKENS rows; q read through its row stride. s12 D1 (H200, CUPTI): W_UK
# 3.3 us a layer at Moonlight b16; s12 D3: 4.6 us at Kimi b1 (8 MB).
ABSORB_SMALL_ENV = "OPENINFER_MLA_ABSORB_SMALL"
DEFAULT_ABSORB_SMALL = False
# mla_absorb_small's builds by the most rows they take (ABSORB_SMALL_TOKENS): each row keeps 8 accumulators a thread,
# so a 4-row build holds ~4x fewer registers (more blocks per SM: Kimi-K2's 64 heads x 8 column blocks in one wave).
ABSORB_SMALL_BUILDS = (4, WRITE_ABSORB_MAX_TOKENS)
# Opt-in: $OPENINFER_MLA_EXPAND_SMALL=1 runs W_UV as mla_expand_small (tensor cores, one launch, fragments straight
# from global memory) instead of cuBLAS's batched GEMM in steps of at most EXPAND_SMALL_MAX_TOKENS rows.
EXPAND_SMALL_ENV = "OPENINFER_MLA_EXPAND_SMALL"
EXPAND_SMALL_MAX_TOKENS, EXPAND_SMALL_COLUMNS, EXPAND_SMALL_THREADS = 64, 16, 128  # mla.cu EXPAND_*
# Opt-in (measured in s16, below): $OPENINFER_MLA_COMBINE_EXPAND=16 / 32 / 64 runs the split combine and W_UV as
# one kernel, mla_combine_expand, in steps with splits to combine and at most COMBINE_EXPAND_MAX_TOKENS rows: each
# block merges its head's splits into bf16 latent rows in shared memory and multiplies them by that many columns of
# W_UV[h] at once (mla_expand_small's mma), so one launch and no o_latent round trip between the two. Why: s16's
# CUPTI timeline of a Kimi-K2 layer at batch 1 (H200, 64 heads, 1k context, 33+ splits) had the combine at 4.8 us,
# W_UV 4.5 us and ~0.5 us between them. Bit-equal to the combine (flat or wide) then mla_expand_small
# ($OPENINFER_MLA_EXPAND_SMALL=1). Each column block merges its head's partials again (more L2 reads with fewer
# columns, more blocks in parallel). 0 (default): two launches. $OPENINFER_MLA_COMBINE_EXPAND_HEAD_SPLITS=N (unset: no
# cap) caps a token's context splits where it runs so that heads x splits stay within N (at least 2): every block
# merges its head's splits, so their count is its work, and fewer partial rows are written and read.
# Measured in s16 (H200; Kimi-K2 layer b1 graph at 1k context, alternated A B ... B A; gpu_mla.py's whole mla_forward
# graph): the cap wins at 1k and loses at 4k, the kernel alone wins only at one token and is about even there, so
# both stay opt-in. D5 (results/kimi_layer_b1_s16d5_h200.json) off 167.4 / 168.9 us, 16 columns 169.9 / 170.6, 32
# 167.7 / 168.0, 64 167.9 / 167.4, 32 with 16 splits 165.4 / 165.6; D6 (kimi_layer_b1_s16d6_h200.json) off 167.3 /
# 168.0, 16 splits alone 166.4 / 166.2, 64 columns + 16 splits 164.9 / 165.7, 32 + 8 169.8 / 168.8, 32 + 32 166.3 /
# 166.5; D7a (kimi_layer_b1_s16d7_h200.json) 64 columns + a 1,024 head-split cap 165.3 / 166.6 / 165.5 / 165.3 vs
# 168.6 / 169.2 / 168.8 / 168.5 without both and with s15's per-call route counter, but gpu_mla (64 heads, b1,
# gpu_mla_combine_expand_h64_s16d7_h200.json) 24.3 vs 25.1 us at 1k and 35.9 vs 31.8 at 4k, and at 4 / 16 tokens
# slower at 16 and 64 heads (16 heads b16 1k 36.3 vs 29.3); D8 (gpu_mla_splitkeys_*_s16d8_h200.json, uncapped, us):
# 64 heads b1 1k / 4k 25.6 / 31.6 vs 24.8 / 32.4 off, 16 heads 24.0 / 30.6 vs 23.2 / 30.2; layer b1 167.8 / 167.3 vs
# 167.9 / 168.2. (Balanced splits of at least 64 keys instead of a cap, so that a short context runs fewer splits
# on the device: D8 layer 167.4 / 167.5 alone, 168.8 / 168.5 with the fused kernel; gpu_mla 64 heads b1 1k 27.6 vs
# 24.8 us. Deleted.)
# After those measurements (no device time left in s16) the kernel makes each row's split weights once per block in
# shared memory instead of every thread walking every split's (max, sum) three times: its merge then costs the splits
# that hold keys, not the grid's split count (the emulated bits unchanged). To measure next, with and without the cap.
COMBINE_EXPAND_ENV = "OPENINFER_MLA_COMBINE_EXPAND"
COMBINE_EXPAND_CHOICES = (16, 32, 64)  # mla.cu COMBINE_EXPAND_COLUMNS builds
DEFAULT_COMBINE_EXPAND = 0
COMBINE_EXPAND_MAX_TOKENS = 16  # mla.cu: the rows of one mma tile
COMBINE_EXPAND_HEAD_SPLITS_ENV = "OPENINFER_MLA_COMBINE_EXPAND_HEAD_SPLITS"
COMBINE_EXPAND_HEAD_SPLITS = 0  # no cap
# Deleted in s15: $OPENINFER_MLA_PDL (opt-in PDL of the decode kernels), within noise and racy. s15 D2 (H200,
# Kimi-K2 layer b1 graph, results/kimi_layer_b1_s15d2_h200.json) 173.5 / 174.1 us vs 173.6 / 173.7 without;
# s12 D1 Moonlight b1 / b16 / b64 0.990 / 1.000 / 1.006x. s15 D6a (H200): test_pdl_decode_bit_equal_to_plain_
# launches[tma-fused-ragged-16] read zeros in graph replay (read before its producer ended; s13 D4: 2 more).
# s12 D1 (H200, benchmarks/gpu_step_timeline.py, results/timeline_moonlight_moon13_d1_h200.json: Moonlight
# decode graphs re-captured in one process, b1 / b16 / b64 step vs the defaults, 2 rounds; noise ~1 %):
# EXPAND_SMALL 0.963 / 0.999 / 0.984x, PDL + WRITE_ABSORB + EXPAND_SMALL 0.997 / 0.947 / 0.974x, PDL +
# GATHER_Q (since deleted) + EXPAND_SMALL 0.987 / 0.999 / 0.965x, TMA_CLUSTER=8 0.970 / 1.009 / 0.956x, =16
# 0.984 / 0.974 / 0.955x, MAX_SPLITS=8 0.933 / 1.004 / 0.994x, =4 0.844 / 0.985 / 0.998x: all stay off. The
# CUPTI timeline of the b16 graph: attention 16.6, write_latent 4.0, W_UK 3.3, combine 3.6, W_UV 3.3 us a
# layer, ~0.1 us between kernels.
# Defaults since E3 (H200, 2026-11-24; both bit-equal to the kernels before, GPU-tested): mla_attention_mma
# with its query and key tiles copied by cp.async (every 16-byte copy of a tile in flight at once) and
# splits past a short context leaving at once (OPENINFER_MLA_ASYNC_TILES=0: the plain loads), and
# mla_combine_splits_shared (each split's weight once per head in shared memory; OPENINFER_MLA_COMBINE=loop:
# mla_combine_splits). One Kimi-K2 layer at batch 1 (results/kimi_layer_b1_e3_h200.json): attention 34.8 ->
# 14.5 us, combine 41.1 -> 21.7 us, layer 334 -> 303 us; whole mla_forward, 64 heads, 1k context: 0.150 ->
# 0.144 / 0.543 -> 0.321 / 1.847 -> 0.849 ms at batch 1 / 64 / 256; 16 heads 0.531 -> 0.309 at 64.
ASYNC_TILES_ENV = "OPENINFER_MLA_ASYNC_TILES"
# Opt-in: OPENINFER_MLA_HEADS16=1 builds mla_attention_mma with blocks of 16 heads whose 4 warps take the 4
# output quarters (one key tile read serves them: 64-head blocks are a quarter each, so Moonlight's 16
# heads read every key tile 4 times and fill a quarter of each 64-row mma tile). H200 E3, whole
# mla_forward with the async tiles: 16 heads 0.148 -> 0.206 ms at batch 1 (behind), 0.309 -> 0.173 at 64,
# 0.814 -> 0.282 at 256; 64 heads 0.144 -> 0.145 / 0.321 -> 0.279 / 0.849 -> 0.705. Fewer head blocks
# mean more context splits, so the bits differ from the 64-head blocks where the split count does.
HEADS16_ENV = "OPENINFER_MLA_HEADS16"
# mla_attention_mma_shared's keys per tile: 32 (default; 93 KB of shared memory, 2 blocks per SM) or 64
# (168 KB, 1 block per SM); $OPENINFER_MLA_SHARED_KEYS.
SHARED_KEYS_ENV = "OPENINFER_MLA_SHARED_KEYS"
SHARED_KEYS_CHOICES = (32, 64)
# (most absorbed rows in the step, keys per tile): the first entry that holds, unless $OPENINFER_MLA_SHARED_KEYS
# says. E1 (H200): 32 at every row count (64 keys: 0.0286 vs 0.0303 ms at batch 1, behind from 16 rows).
SHARED_KEYS_BY_ROWS: tuple[tuple[int, int], ...] = ((1 << 30, 32),)
SHARED_HEADS, SHARED_THREADS = 16, 128
# mla_attention_mma_shared with each warp's query A fragments held in registers (144 per thread, 254 in all:
# still 2 blocks per SM) rather than re-read from shared memory for every key tile (two thirds of its
# score-phase shared-memory reads); latents up to 576 wide. Default since s7 E1 (H200, 2026-11-24, gpu_mla.py,
# Moonlight's 16 heads; bit-equal): attention kernel 0.1303 -> 0.1194 ms at batch 256 x 1k (54 -> 59 % of the
# latent bytes over the copy rate), 0.4681 -> 0.4296 at 256 x 4k (60 -> 66 %), 0.1294 -> 0.1186 at 64 x 4k
# (55 -> 60 %), 0.0414 -> 0.0389 at 64 x 1k, 0.0407 -> 0.0381 at 16 x 4k, 0.0180 -> 0.0173 at 16 x 1k;
# OPENINFER_MLA_SHARED_Q_REGS=0: the shared-memory reads.
SHARED_Q_REGS_ENV = "OPENINFER_MLA_SHARED_Q_REGS"
SHARED_Q_REGS_MAX_LATENT = 576
SHARED_SPLITS_ENV = "OPENINFER_MLA_SHARED_SPLITS"  # resident (default) or waves: see resident_splits
COMBINE_ENV = "OPENINFER_MLA_COMBINE"
# "wide" (default since E2, H200): mla_combine_splits_shared over KV_LORA / 128 blocks per head, reading only
# the non-empty splits (bit-equal, GPU-tested); 16 heads, graph-replayed mla_forward: batch 1 0.0295 -> 0.0233
# ms at 1k context (combine 10.7 -> 5.3 us), 0.0378 -> 0.0301 at 4k; batch 16 0.0354 -> 0.0323 / 0.0630 ->
# 0.0590; batch 64 equal; 256 runs one split (no combine). $OPENINFER_MLA_COMBINE=shared: the former.
# mla_combine_splits_flat (a thread per 4 output dims, no shared memory or barrier, 16 splits' partial rows loaded
# together; bit-equal to wide, GPU-tested): the default up to COMBINE_FLAT_MAX_SPLITS splits. s10 D2 (H200,
# results/mla13c_h16_s10d2.json / _h64_, combine kernel alone, 1k context, us, wide -> flat): 4 splits 9.5 -> 7.0
# (16 heads x 64 rows), 9.6 -> 7.2 (64 x 16), 12.5 -> 4.7 (64 x 64); 16 splits 5.0 -> 5.9, 64 splits 5.4 -> 9.1
# (behind). $OPENINFER_MLA_COMBINE=wide / flat forces one.
COMBINE_KERNELS = {"loop": "mla_combine_splits", "shared": "mla_combine_splits_shared",
                   "wide": "mla_combine_splits_wide", "flat": "mla_combine_splits_flat"}
COMBINE_FLAT_THREADS = 256  # mla.cu
COMBINE_FLAT_MAX_SPLITS = 4
COMBINE_WIDE_DIMS = 128  # output dims per block of mla_combine_splits_wide
COMBINE_SHARED_MAX_SPLITS = 64  # mla.cu COMBINE_MAX_SPLITS (more splits take the loop)
NULL = np.uint64(0)
PREFILL_THREADS = 128
# The decompressed prefill's attention kernel ($OPENINFER_MLA_PREFILL): "wgmma" (default; mla_prefill_attention_sm90
# in mla_prefill_sm90.cu, Hopper only: 128-query tiles, a producer warpgroup filling a 2-stage ring of 128-key
# tiles, two consumer warpgroups on wgmma; elsewhere, or for shapes it does not take, the pipelined kernel runs),
# "pipelined" (mla_prefill_attention_pipelined in mla.cu: 64-key K / V tiles double-buffered by cp.async,
# ldmatrix fragments, mma.sync) or "plain" (mla_prefill_attention, the first one; the CPU emulation's build).
# H200, gpu_mla.py, attention kernel alone, one prompt: s6 E1 plain -> pipelined 16 heads 1k 0.213 -> 0.064 ms,
# 8k 5.27 -> 1.94 ms; s7 E1 (2026-11-24, results/gpu_mla_s7_e1_h200.json) pipelined -> wgmma with its default
# variant (ping-pong + split K / V + TMA) 16 heads 1k 0.0652 -> 0.0230 ms, 4k 0.578 -> 0.174, 8k 1.965 -> 0.540 ms
# (175 -> 636 TFLOP/s, 3.64x); 64 heads (Kimi-K2) 1k 0.178 -> 0.069, 4k 1.941 -> 0.567, 8k 7.23 -> 2.01 ms (190 ->
# 684 TFLOP/s).
PREFILL_KERNEL_ENV = "OPENINFER_MLA_PREFILL"
PREFILL_KERNELS = {"plain": "mla_prefill_attention", "pipelined": "mla_prefill_attention_pipelined",
                   "wgmma": "mla_prefill_attention_sm90"}
PREFILL_KERNEL_TILE = {"plain": 64, "pipelined": 64, "wgmma": 128}  # queries per block
DEFAULT_PREFILL_KERNEL = "wgmma"
SM90_PREFILL_THREADS = 384  # mla_prefill_sm90.cu: producer + 2 consumer warpgroups
# Its keys per K / V tile (BLOCK_N) and ring depth (STAGES) that fit 227 KB beside the 128-query tile:
# 128 keys in 2 stages (default) or 64 in 4 ($OPENINFER_MLA_SM90_KEYS); $OPENINFER_MLA_SM90_PINGPONG=1: the
# consumer warpgroups take turns issuing wgmmas (PINGPONG); $OPENINFER_MLA_SM90_SPLIT_KV=1: K and V halves of
# a stage on their own barriers, K copied a tile ahead of V (SPLIT_KV); $OPENINFER_MLA_SM90_TMA=1: K / V tiles by
# TMA boxes from one producer thread (TMA_KV_LOADS; nope and rope in whole 64-column blocks, else cp.async);
# $OPENINFER_MLA_SM90_ORDERED=1: the softmax pinned before the wait for the previous P V (ORDERED_SOFTMAX).
# Defaults by s7 E1 (H200, 16 heads, 8k prompt, attention ms): 128 keys 1.035, 64 keys (+ ping-pong + split)
# 0.972, ping-pong 1.000, split 0.801, ping-pong + split 0.799, TMA 0.714, TMA + ping-pong + split 0.540 (the
# best at every length and head count measured); =0 on each switch goes back. ORDERED by s7 E2 (H200): 0.546 -> 0.539
# ms at 16 heads 8k, 0.174 -> 0.171 at 4k, 2.044 -> 2.015 at 64 heads 8k (faster at all six points).
SM90_PREFILL_STAGES = {128: 2, 64: 4}
SM90_KEYS_ENV, DEFAULT_SM90_KEYS = "OPENINFER_MLA_SM90_KEYS", 128
SM90_PINGPONG_ENV, DEFAULT_SM90_PINGPONG = "OPENINFER_MLA_SM90_PINGPONG", True
SM90_SPLIT_KV_ENV, DEFAULT_SM90_SPLIT_KV = "OPENINFER_MLA_SM90_SPLIT_KV", True
SM90_TMA_ENV, DEFAULT_SM90_TMA = "OPENINFER_MLA_SM90_TMA", True
SM90_ORDERED_ENV, DEFAULT_SM90_ORDERED = "OPENINFER_MLA_SM90_ORDERED", True
LOG2E = 1.4426950408889634
PIPELINED_PREFILL_KEYS = 64
# A sequence whose step brings at least this many queries takes the decompressed form (measured on
# an H100, benchmarks/gpu_kimi.py kernels: see results/kimi_kernels.json).
PREFILL_MIN_QUERY = 16
# Cap on the expanded keys + values of one step (bytes); sequences past it stay absorbed.
PREFILL_SCRATCH_BYTES = 2 << 30


def choose_absorbed_kernel(num_heads: int, num_tokens: int, absorbed_kernel: str | None = None) -> str:
    """The absorbed attention kernel for a step of ``num_tokens`` absorbed rows (see ABSORBED_KERNELS):
    ``absorbed_kernel``, else $OPENINFER_MLA_DECODE, unless "auto"/unset: ABSORBED_KERNEL_CHOICE.
    Depends on the row count only, so a captured decode graph keeps its choice."""
    name = absorbed_kernel or os.environ.get(ABSORBED_KERNEL_ENV) or "auto"
    if name == "auto":
        for most_heads, most_tokens, choice in ABSORBED_KERNEL_CHOICE:
            if num_heads <= most_heads and num_tokens <= most_tokens:
                return choice
        return DEFAULT_ABSORBED_KERNEL
    if name not in ABSORBED_KERNELS:
        raise ValueError(f"absorbed MLA kernel ({ABSORBED_KERNEL_ENV}) is auto, {', '.join(ABSORBED_KERNELS)}; "
                         f"got {name!r}")
    return name


def num_splits(num_tokens: int, head_chunks: int, num_sms: int) -> int:
    """Context splits per token: about two waves of blocks over the SMs, at most MAX_SPLITS (or
    $OPENINFER_MLA_MAX_SPLITS), 1 for prefill-sized steps. Depends on the token count only, so a
    captured decode graph stays valid for every context length."""
    most = int(os.environ.get(MAX_SPLITS_ENV) or MAX_SPLITS)
    if most < 1:
        raise ValueError(f"{MAX_SPLITS_ENV} must be at least 1, got {most}")
    return max(1, min(most, -(-2 * num_sms // (num_tokens * head_chunks))))


def resident_splits(num_tokens: int, head_chunks: int, num_sms: int, blocks_per_sm: int) -> int:
    """mla_attention_mma_shared's context splits ($OPENINFER_MLA_SHARED_SPLITS=resident, its default):
    as many as keep every block resident at once (one wave: ``blocks_per_sm`` per SM), at least 1, at most
    MAX_SPLITS ($OPENINFER_MLA_MAX_SPLITS); =waves: ``num_splits``' two waves. Row count only (graph-safe)."""
    policy = os.environ.get(SHARED_SPLITS_ENV) or "resident"
    if policy not in ("resident", "waves"):
        raise ValueError(f"{SHARED_SPLITS_ENV} is resident or waves; got {policy!r}")
    if policy == "waves":
        return num_splits(num_tokens, head_chunks, num_sms)
    most = int(os.environ.get(MAX_SPLITS_ENV) or MAX_SPLITS)
    if most < 1:
        raise ValueError(f"{MAX_SPLITS_ENV} must be at least 1, got {most}")
    return max(1, min(most, blocks_per_sm * num_sms // (num_tokens * head_chunks)))


def _defines(spec: MLASpec) -> dict[str, int]:
    return {"KV_LORA": spec.kv_lora_rank, "ROPE_DIM": spec.qk_rope_dim, "NOPE_DIM": spec.qk_nope_dim,
            "V_DIM": spec.v_head_dim}


def check_spec(spec: MLASpec) -> None:
    if spec.kv_lora_rank % 16 or spec.qk_rope_dim % 2:
        raise ValueError(f"cuda MLA needs kv_lora_rank % 16 == 0 and an even rope dim, got {spec.kv_lora_rank}, "
                         f"{spec.qk_rope_dim}")


def decompressed_fits(spec: MLASpec) -> bool:
    """mla_prefill_attention's shape limits: 16-wide mma steps over nope + rope and v, 8-wide loads."""
    return (spec.qk_head_dim % 16 == 0 and spec.v_head_dim % 16 == 0 and spec.qk_nope_dim % 8 == 0
            and spec.qk_rope_dim % 8 == 0)


def sm90_prefill_fits(spec: MLASpec) -> bool:
    """mla_prefill_attention_sm90's shape limits: K rows of whole 64-wide column blocks (8-wide nope and
    rope parts), v 128 (one wgmma n=128 accumulator)."""
    return (spec.qk_head_dim % 64 == 0 and spec.qk_nope_dim % 8 == 0 and spec.qk_rope_dim % 8 == 0
            and spec.v_head_dim == 128)


@functools.cache
def _is_hopper(device_id: int) -> bool:
    return cupy.cuda.Device(device_id).compute_capability == "90"


@dataclass(frozen=True)
class PrefillPlan:
    """A step's ``DecompressedPrefill`` on the device."""

    seqs: cupy.ndarray
    tile_seq: cupy.ndarray
    tile_query: cupy.ndarray
    query_rows: cupy.ndarray
    absorbed_rows: cupy.ndarray | None
    context_rows: int
    kernel: str  # the attention kernel it is laid out for (PREFILL_KERNELS)


def plan_prefill(host: ForwardBatch | None, spec: MLASpec, min_query: int = PREFILL_MIN_QUERY,
                 scratch_bytes: int = PREFILL_SCRATCH_BYTES) -> PrefillPlan | None:
    if host is None or host.max_query_len < min_query or not decompressed_fits(spec):
        return None
    attention = prefill_kernel(spec)
    layout = decompressed_prefill_layout(host, spec, min_query, scratch_bytes, PREFILL_KERNEL_TILE[attention])
    if layout is None:
        return None
    return PrefillPlan(cupy.asarray(layout.seqs), cupy.asarray(layout.tile_seq), cupy.asarray(layout.tile_query),
                       cupy.asarray(layout.query_rows),
                       cupy.asarray(layout.absorbed_rows) if layout.absorbed_rows.size else None,
                       layout.context_rows, attention)


_last_plan: tuple[object, PrefillPlan | None] | None = None


def _step_plan(batch, spec: MLASpec, min_query: int) -> PrefillPlan | None:
    """``plan_prefill`` once per step (every layer of a step shares it)."""
    global _last_plan
    host = getattr(batch, "host", None)
    if host is None or host.max_query_len < min_query:
        return None
    key = (id(batch), spec.num_heads, spec.qk_head_dim, spec.v_head_dim, min_query, prefill_kernel(spec))
    if _last_plan is not None and _last_plan[0][0] is batch and _last_plan[0][1:] == key[1:]:
        return _last_plan[1]
    plan = plan_prefill(host, spec, min_query)
    _last_plan = ((batch, *key[1:]), plan)
    return plan


def mla_forward(blas: Cublas, q: cupy.ndarray, latent: cupy.ndarray, cache: cupy.ndarray, w_uk: cupy.ndarray,
                w_uv: cupy.ndarray, kv_a_norm: cupy.ndarray, spec: MLASpec, batch, cos: cupy.ndarray,
                sin: cupy.ndarray, eps: float, num_sms: int = 132,
                prefill_min_query: int = PREFILL_MIN_QUERY, absorbed_kernel: str | None = None) -> cupy.ndarray:
    """``q [T, H·(nope+rope)]`` (rope dims not yet rotated; rotated on a copy here) and ``latent``
    ``[T, lora + rope]`` (a row view of kv_a's output, un-normed) → attention output ``[T, H·v]``.
    ``cache`` is the layer's ``[num_blocks, block_size, …, lora + rope]`` bf16 latent cache;
    ``w_uk [H, nope, lora]`` and ``w_uv [H, v, lora]`` are kv_b split per head (bf16). Sequences
    with at least ``prefill_min_query`` new tokens take the decompressed form (module docstring);
    ``absorbed_kernel`` forces the absorbed form's kernel (``choose_absorbed_kernel``)."""
    check_spec(spec)
    num_tokens = int(q.shape[0])
    heads = spec.num_heads
    out = cupy.empty((num_tokens, heads * spec.v_head_dim), dtype=cupy.uint16)
    if num_tokens == 0:
        return out
    plan = _step_plan(batch, spec, prefill_min_query)
    if plan is None and write_absorb_fits(num_tokens, spec):
        q = cupy.ascontiguousarray(q)  # its rope dims are rotated in place: callers pass a buffer they own
        q_latent = write_latent_absorb(q, latent, cache, kv_a_norm, w_uk, spec, batch, cos, sin, eps)
        attend_and_expand(blas, q_latent, q, cache, w_uv, spec, batch, out, None, num_sms, absorbed_kernel)
        return out
    if plan is None and absorb_side():
        q = cupy.ascontiguousarray(q)  # its rope dims are rotated in place: callers pass a buffer they own
        q_latent = write_latent_beside_absorb(blas, q, latent, cache, kv_a_norm, w_uk, spec, batch, cos, sin, eps)
        attend_and_expand(blas, q_latent, q, cache, w_uv, spec, batch, out, None, num_sms, absorbed_kernel)
        return out
    if plan is None and fused_write_fits(q, spec, batch):
        q_latent = absorb_queries(blas, q, w_uk, spec)  # q's nope dims where they lie
        write = LatentWrite(latent, kv_a_norm, eps, cos, sin)
        attend_and_expand(blas, q_latent, q, cache, w_uv, spec, batch, out, None, num_sms, absorbed_kernel,
                          latent_write=write)
        return out
    if plan is None and q_view_fits(q, spec):
        q_pe = write_latent_q_pe(q, latent, cache, kv_a_norm, spec, batch, cos, sin, eps)
        q_latent = absorb_queries(blas, q, w_uk, spec)
        attend_and_expand(blas, q_latent, q_pe, cache, w_uv, spec, batch, out, None, num_sms, absorbed_kernel,
                          q_pe_only=True)
        return out
    q = cupy.ascontiguousarray(q)  # its rope dims are rotated in place: callers pass a buffer they own
    write_latent(q, latent, cache, kv_a_norm, spec, batch, cos, sin, eps)
    if plan is None:
        _absorbed(blas, q, cache, w_uk, w_uv, spec, batch, out, None, num_sms, absorbed_kernel)
        return out
    _decompressed(blas, q, cache, w_uk, w_uv, spec, batch, plan, out)
    if plan.absorbed_rows is not None:
        rows = plan.absorbed_rows
        rest = cupy.empty((int(rows.shape[0]), heads * spec.v_head_dim), dtype=cupy.uint16)
        _absorbed(blas, cupy.ascontiguousarray(q[rows]), cache, w_uk, w_uv, spec, batch, rest, rows, num_sms,
                  absorbed_kernel)
        out[rows] = rest
    return out


# Opt-in, measured within noise (s12 D2b, Moonlight decode graphs: b1 / b16 / b64 1.010 / 1.000 / 1.005x):
# $OPENINFER_MLA_ABSORB_SIDE=1 runs a step's W_UK (``absorb_queries``: cuBLAS over q's nope
# dims) on a side stream beside the latent write (which rotates q's rope dims in place: other bytes of q), joined
# before the attention; in a captured decode graph the two become parallel branches. s12 D1 (H200, CUPTI, Moonlight
# b16): write_latent 4.0 and W_UK 3.3 us back to back in every layer. The same kernels: the same bits.
ABSORB_SIDE_ENV = "OPENINFER_MLA_ABSORB_SIDE"
_absorb_streams: dict[int, tuple[cupy.cuda.Stream, cupy.cuda.Event, cupy.cuda.Event]] = {}


def absorb_side() -> bool:
    """$OPENINFER_MLA_ABSORB_SIDE (0 / 1; unset: 0; another value: a clear error)."""
    text = os.environ.get(ABSORB_SIDE_ENV) or "0"
    if text not in ("0", "1"):
        raise ValueError(f"{ABSORB_SIDE_ENV} is 0 or 1; got {text!r}")
    return text == "1"


def _absorb_stream() -> tuple[cupy.cuda.Stream, cupy.cuda.Event, cupy.cuda.Event]:
    """This device's side stream for W_UK and its fork / join events (made at the first use)."""
    device = cupy.cuda.Device().id
    if device not in _absorb_streams:
        _absorb_streams[device] = (cupy.cuda.Stream(non_blocking=True), cupy.cuda.Event(disable_timing=True),
                                   cupy.cuda.Event(disable_timing=True))
    return _absorb_streams[device]


def write_latent_beside_absorb(blas: Cublas, q: cupy.ndarray, latent: cupy.ndarray, cache: cupy.ndarray,
                               kv_a_norm: cupy.ndarray, w_uk: cupy.ndarray, spec: MLASpec, batch, cos: cupy.ndarray,
                               sin: cupy.ndarray, eps: float) -> cupy.ndarray:
    """``write_latent`` of contiguous ``q`` on this stream and ``absorb_queries(q)`` (its nope dims) on the side
    stream at the same time; returns q_latent once this stream has joined the side stream."""
    side, forked, joined = _absorb_stream()
    current = cupy.cuda.get_current_stream()
    forked.record(current)
    side.wait_event(forked)
    with side:
        q_latent = absorb_queries(blas, q, w_uk, spec)
        joined.record(side)
    write_latent(q, latent, cache, kv_a_norm, spec, batch, cos, sin, eps)
    current.wait_event(joined)
    return q_latent


def write_latent(q: cupy.ndarray, latent: cupy.ndarray, cache: cupy.ndarray, kv_a_norm: cupy.ndarray, spec: MLASpec,
                 batch, cos: cupy.ndarray, sin: cupy.ndarray, eps: float) -> None:
    """``mla_write_latent``: the step's latent rows (RMS-normed c_kv, rotated k_pe) into their cache
    slots, and every head's q_pe of contiguous ``q`` rotated in place."""
    heads = spec.num_heads
    # spread: each thread rotates one head pair of q_pe (one block per token rotates all 64 heads'
    # in 16 dependent in-place rounds)
    spread = os.environ.get(SPREAD_ROPE_ENV, "1") not in ("0", "false", "off")
    rope_blocks = -(-heads * spec.qk_rope_dim // 2 // 128) if spread else 1
    kernel("mla.cu", "mla_write_latent", **_defines(spec))((int(q.shape[0]), rope_blocks), (128,), (
        latent, np.int32(latent.strides[0] // 2), kv_a_norm, np.float32(eps), q, np.int32(heads),
        np.int32(spec.qk_head_dim), np.int32(spec.qk_nope_dim), batch.positions, batch.slot_mapping, cos, sin, cache))


@dataclass(frozen=True)
class LatentWrite:
    """The latent write an attention kernel does itself (``fused_write_fits``): the step's un-normed latent rows (a
    row view), the norm and the rope tables."""

    latent: cupy.ndarray
    kv_a_norm: cupy.ndarray
    eps: float
    cos: cupy.ndarray
    sin: cupy.ndarray


def fused_write_fits(q: cupy.ndarray, spec: MLASpec, batch) -> bool:
    """Whether ``mla_forward``'s absorbed step folds the latent write into the attention kernel
    ($OPENINFER_MLA_FUSED_WRITE 1 / 0, unset: DEFAULT_FUSED_WRITE; another value: a clear error): one new token per
    sequence (rows == sequences: decode steps and their graphs) and q in rows of unit column stride (read in place,
    as $OPENINFER_MLA_Q_VIEW). Kernels other than mla_attention_tma take the q_pe write (``attend_splits``)."""
    text = os.environ.get(FUSED_WRITE_ENV)
    if text not in (None, "", "0", "1"):
        raise ValueError(f"{FUSED_WRITE_ENV} is 0 or 1; got {text!r}")
    rows = int(q.shape[0])
    wanted = text == "1" if text else DEFAULT_FUSED_WRITE and rows >= FUSED_WRITE_MIN_ROWS  # unset: the default's rows
    return (wanted and q.ndim == 2 and q.strides[1] == q.itemsize and q.strides[0] % q.itemsize == 0
            and q.shape[1] == spec.num_heads * spec.qk_head_dim and rows == int(batch.num_seqs))


def q_view_fits(q: cupy.ndarray, spec: MLASpec) -> bool:
    """Whether ``mla_forward``'s absorbed step reads ``q`` where it lies ($OPENINFER_MLA_Q_VIEW 1 / 0, unset:
    DEFAULT_Q_VIEW; another value: a clear error): rows of unit column stride and 2-byte-aligned row stride."""
    text = os.environ.get(Q_VIEW_ENV) or str(int(DEFAULT_Q_VIEW))
    if text not in ("0", "1"):
        raise ValueError(f"{Q_VIEW_ENV} is 0 or 1; got {text!r}")
    return (text == "1" and q.ndim == 2 and q.strides[1] == q.itemsize and q.strides[0] % q.itemsize == 0
            and q.shape[1] == spec.num_heads * spec.qk_head_dim)


def write_latent_q_pe(q_rows: cupy.ndarray, latent: cupy.ndarray, cache: cupy.ndarray, kv_a_norm: cupy.ndarray,
                      spec: MLASpec, batch, cos: cupy.ndarray, sin: cupy.ndarray, eps: float) -> cupy.ndarray:
    """``mla_write_latent_q_pe``: the latent rows stored (as ``write_latent``) and every head's rotated q_pe of
    ``q_rows`` (a row view or contiguous; left as it is) returned as its own ``[T, H, rope]``."""
    heads = spec.num_heads
    q_pe = cupy.empty((int(q_rows.shape[0]), heads, spec.qk_rope_dim), dtype=cupy.uint16)
    spread = os.environ.get(SPREAD_ROPE_ENV, "1") not in ("0", "false", "off")
    rope_blocks = -(-heads * spec.qk_rope_dim // 2 // 128) if spread else 1
    kernel("mla.cu", "mla_write_latent_q_pe", **_defines(spec))((int(q_rows.shape[0]), rope_blocks), (128,), (
        latent, np.int32(latent.strides[0] // 2), kv_a_norm, np.float32(eps), q_rows, np.int32(q_rows.strides[0] // 2),
        q_pe, np.int32(heads), np.int32(spec.qk_head_dim), np.int32(spec.qk_nope_dim), batch.positions,
        batch.slot_mapping, cos, sin, cache))
    return q_pe


def write_absorb_fits(num_tokens: int, spec: MLASpec) -> bool:
    """Whether a decode step of ``num_tokens`` rows takes mla_write_absorb ($OPENINFER_MLA_WRITE_ABSORB=1, at most
    WRITE_ABSORB_MAX_TOKENS rows, whole 64-column blocks of the latent, at least two of them). Row count only."""
    text = os.environ.get(WRITE_ABSORB_ENV) or "0"
    if text not in ("0", "1"):
        raise ValueError(f"{WRITE_ABSORB_ENV} is 0 or 1; got {text!r}")
    return (text == "1" and 0 < num_tokens <= WRITE_ABSORB_MAX_TOKENS and spec.kv_lora_rank % WRITE_ABSORB_COLUMNS == 0
            and spec.kv_lora_rank >= 2 * WRITE_ABSORB_COLUMNS and spec.qk_nope_dim % 16 == 0)


def write_latent_absorb(q: cupy.ndarray, latent: cupy.ndarray, cache: cupy.ndarray, kv_a_norm: cupy.ndarray,
                        w_uk: cupy.ndarray, spec: MLASpec, batch, cos: cupy.ndarray, sin: cupy.ndarray,
                        eps: float) -> cupy.ndarray:
    """``mla_write_absorb``: ``write_latent`` and ``absorb_queries`` in one launch; returns ``q_latent [T, H, lora]``
    (q's rope dims rotated in place, the latent rows stored)."""
    num_tokens, heads = int(q.shape[0]), spec.num_heads
    q_latent = cupy.empty((num_tokens, heads, spec.kv_lora_rank), dtype=cupy.uint16)
    kernel("mla.cu", "mla_write_absorb", **_defines(spec))(
        (heads, spec.kv_lora_rank // WRITE_ABSORB_COLUMNS), (WRITE_ABSORB_THREADS,),
        (latent, np.int32(latent.strides[0] // 2), kv_a_norm, np.float32(eps), q, np.int32(heads),
         np.int32(spec.qk_head_dim), np.int32(spec.qk_nope_dim), np.int32(num_tokens), w_uk, q_latent, batch.positions,
         batch.slot_mapping, cos, sin, cache))
    return q_latent


def mma_decode_fits(spec: MLASpec) -> bool:
    """mla_attention_mma's shape limits: 16-wide mma steps over the latent, 8-wide output quarters."""
    return spec.latent_dim % 16 == 0 and spec.kv_lora_rank % (8 * MMA_DECODE_PARTS) == 0 and spec.qk_head_dim % 8 == 0 \
        and spec.qk_nope_dim % 8 == 0


def shared_decode_fits(spec: MLASpec) -> bool:
    """mla_attention_mma_shared's shape limits: 32-wide score steps over the latent, output quarters of
    16-wide steps."""
    return mma_decode_fits(spec) and spec.latent_dim % 32 == 0 and spec.kv_lora_rank % 64 == 0


_smem_set: dict[int, cupy.RawKernel] = {}  # id -> the kernel (held, so its id is never reused)


def async_tiles() -> bool:
    """Whether mla_attention_mma copies its tiles by cp.async (default; $OPENINFER_MLA_ASYNC_TILES=0: not)."""
    return os.environ.get(ASYNC_TILES_ENV, "1") not in ("0", "false", "off")


def heads16() -> bool:
    """Whether the "mma" kernel runs blocks of 16 heads ($OPENINFER_MLA_HEADS16=1; "mma16" always does)."""
    return os.environ.get(HEADS16_ENV, "0") in ("1", "true", "on")


def mma_decode_head_chunks(num_heads: int, blocks_of_16: bool | None = None) -> int:
    """mla_attention_mma's grid.y: head blocks x output quarters (64-head blocks), or 16-head blocks."""
    if heads16() if blocks_of_16 is None else blocks_of_16:
        return -(-num_heads // 16)
    return -(-num_heads // MMA_DECODE_HEADS) * MMA_DECODE_PARTS


def shared_keys(num_tokens: int = 1 << 30) -> int:
    """mla_attention_mma_shared's keys per tile for a step of ``num_tokens`` absorbed rows
    ($OPENINFER_MLA_SHARED_KEYS, else SHARED_KEYS_BY_ROWS; row count only: graph-safe)."""
    text = os.environ.get(SHARED_KEYS_ENV)
    if not text:
        return next(keys for most_rows, keys in SHARED_KEYS_BY_ROWS if num_tokens <= most_rows)
    if not text.isdigit() or int(text) not in SHARED_KEYS_CHOICES:
        raise ValueError(f"{SHARED_KEYS_ENV} is one of {', '.join(map(str, SHARED_KEYS_CHOICES))}; got {text!r}")
    return int(text)


def shared_decode_smem(spec: MLASpec, keys: int) -> int:
    """mla_attention_mma_shared's dynamic shared memory (mla.cu MLA_SHARED_SMEM): the query tile, two
    key tiles (padded rows), the bf16 probabilities and the warps' row maxima and sums."""
    row = spec.latent_dim + 8
    return (SHARED_HEADS + 2 * keys) * row * 2 + SHARED_HEADS * (keys + 8) * 2 + 2 * 4 * SHARED_HEADS * 4


def shared_q_regs(spec: MLASpec) -> bool:
    """Whether mla_attention_mma_shared keeps the query fragments in registers ($OPENINFER_MLA_SHARED_Q_REGS,
    default 1, and a latent of at most SHARED_Q_REGS_MAX_LATENT)."""
    value = os.environ.get(SHARED_Q_REGS_ENV) or "1"
    if value not in ("0", "1"):
        raise ValueError(f"{SHARED_Q_REGS_ENV} is 0 or 1; got {value!r}")
    return value == "1" and spec.latent_dim <= SHARED_Q_REGS_MAX_LATENT


def _shared_decode_kernel(spec: MLASpec, keys: int):
    smem = shared_decode_smem(spec, keys)
    q_regs = {"MLA_SHARED_Q_REGS": 1} if shared_q_regs(spec) else {}
    attention = kernel("mla.cu", "mla_attention_mma_shared", **_defines(spec), MLA_SHARED_KEYS=keys, **q_regs)
    if isinstance(attention, cupy.RawKernel) and id(attention) not in _smem_set:
        attention.max_dynamic_shared_size_bytes = smem
        _smem_set[id(attention)] = attention
    return attention, smem


def combine_kernel(splits: int = 1) -> str:
    """The split combine's kernel for ``splits`` context splits ($OPENINFER_MLA_COMBINE: wide, shared, loop or flat;
    unset or auto: flat up to COMBINE_FLAT_MAX_SPLITS splits, else wide). Split count only: graph-safe."""
    name = os.environ.get(COMBINE_ENV) or "auto"
    if name == "auto":
        name = "flat" if splits <= COMBINE_FLAT_MAX_SPLITS else "wide"
    if name not in COMBINE_KERNELS:
        raise ValueError(f"{COMBINE_ENV} is auto or one of {', '.join(COMBINE_KERNELS)}; got {name!r}")
    return COMBINE_KERNELS[name]


def _mma_decode_kernel(spec: MLASpec, blocks_of_16: bool):
    """The compiled kernel, allowed its dynamic shared memory (Q tile + one key tile, > 48 KB)."""
    smem = ((16 if blocks_of_16 else MMA_DECODE_HEADS) + MMA_DECODE_KEYS) * (spec.latent_dim + 8) * 2
    attention = kernel("mla.cu", "mla_attention_mma", **_defines(spec),
                       **({"MLA_ASYNC_TILES": 1} if async_tiles() else {}),
                       **({"MLA_HEADS16": 1} if blocks_of_16 else {}))
    # under discover_kernels `attention` is a stand-in that launches nothing: nothing to allow yet
    if isinstance(attention, cupy.RawKernel) and id(attention) not in _smem_set:
        attention.max_dynamic_shared_size_bytes = smem
        _smem_set[id(attention)] = attention
    return attention, smem


def absorb_small_fits(num_tokens: int, spec: MLASpec) -> bool:
    """Whether W_UK of ``num_tokens`` rows runs mla_absorb_small ($OPENINFER_MLA_ABSORB_SMALL 1 / 0, unset:
    DEFAULT_ABSORB_SMALL; another value: a clear error; at most WRITE_ABSORB_MAX_TOKENS rows, whole 64-column blocks
    of the latent, nope in 16 row groups). Row count only: graph-safe."""
    text = os.environ.get(ABSORB_SMALL_ENV) or str(int(DEFAULT_ABSORB_SMALL))
    if text not in ("0", "1"):
        raise ValueError(f"{ABSORB_SMALL_ENV} is 0 or 1; got {text!r}")
    return (text == "1" and 0 < num_tokens <= WRITE_ABSORB_MAX_TOKENS and spec.kv_lora_rank % WRITE_ABSORB_COLUMNS == 0
            and spec.qk_nope_dim % 16 == 0)


def absorb_queries(blas: Cublas, q: cupy.ndarray, w_uk: cupy.ndarray, spec: MLASpec) -> cupy.ndarray:
    """W_UK: ``q_latent [T, H, lora]`` from the nope dims of ``q [T, H·(nope+rope)]`` (one strided-batched GEMM, or
    mla_absorb_small; ``q`` contiguous or a row view of unit column stride)."""
    num_tokens, heads, nope, lora = int(q.shape[0]), spec.num_heads, spec.qk_nope_dim, spec.kv_lora_rank
    q_latent = cupy.empty((num_tokens, heads, lora), dtype=cupy.uint16)
    if absorb_small_fits(num_tokens, spec):
        most = ABSORB_SMALL_BUILDS[0] if num_tokens <= ABSORB_SMALL_BUILDS[0] else ABSORB_SMALL_BUILDS[1]
        kernel("mla.cu", "mla_absorb_small", **_defines(spec), ABSORB_SMALL_TOKENS=most)(
            (heads, lora // WRITE_ABSORB_COLUMNS), (WRITE_ABSORB_THREADS,),
            (q, np.int32(q.strides[0] // q.itemsize), np.int32(spec.qk_head_dim), np.int32(heads),
             np.int32(num_tokens), w_uk, q_latent))
        return q_latent
    # q_latent_h^T [lora x T] = W_UK[h]^T [lora x nope] . q_nope_h^T [nope x T]   (column-major)
    row_stride = q.strides[0] // q.itemsize  # heads·(nope+rope) for a contiguous q; a row view's own stride
    blas.matmul_strided_batched(False, False, lora, num_tokens, nope, w_uk, lora, nope * lora,
                                q, row_stride, spec.qk_head_dim, q_latent, heads * lora, lora, heads)
    return q_latent


@dataclass(frozen=True)
class SplitPartials:
    """The context splits' normalised outputs and (max, sum) per head, for ``combine_splits``."""

    partial_o: cupy.ndarray  # [T, H, splits, lora] fp32
    partial_ml: cupy.ndarray  # [T, H, splits, 2] fp32
    splits: int


def absorbed_attention(q_latent: cupy.ndarray, q: cupy.ndarray, cache: cupy.ndarray, spec: MLASpec, batch,
                       token_rows: cupy.ndarray | None, num_sms: int, absorbed_kernel: str | None = None,
                       q_pe_only: bool = False, latent_write: LatentWrite | None = None) -> cupy.ndarray:
    """``o_latent [T, H, lora]``: attention of the rows' absorbed queries (``q_latent``, and q's
    rotated rope dims) over their sequences' cached latents, split over the context and combined.
    ``token_rows``: each row's token in the step (None: row i is token i); ``q_pe_only``: ``q`` holds only the
    rotated rope dims, ``[T, H, rope]`` (write_latent_q_pe); ``latent_write``: the step's latent rows are not in the
    cache yet and q's rope dims not rotated (``fused_write_fits``)."""
    o_latent, partials = attend_splits(q_latent, q, cache, spec, batch, token_rows, num_sms, absorbed_kernel,
                                       q_pe_only, latent_write)
    if partials is not None:
        combine_splits(partials, o_latent, spec)
    return o_latent


def combine_splits(partials: SplitPartials, o_latent: cupy.ndarray, spec: MLASpec) -> None:
    """``o_latent`` from the splits' partials (``combine_kernel``'s kernel)."""
    rows = int(partials.partial_ml.shape[0] * partials.partial_ml.shape[1])
    name = combine_kernel(partials.splits)
    if partials.splits > COMBINE_SHARED_MAX_SPLITS:
        name = COMBINE_KERNELS["loop"]
    args = (partials.partial_o, partials.partial_ml, np.int32(partials.splits))
    if name == COMBINE_KERNELS["flat"]:
        grid = -(-rows * (spec.kv_lora_rank // 4) // COMBINE_FLAT_THREADS)
        kernel("mla.cu", name, **_defines(spec))((grid,), (COMBINE_FLAT_THREADS,), (*args, np.int32(rows), o_latent))
        return
    grid = (rows, -(-spec.kv_lora_rank // COMBINE_WIDE_DIMS)) if name == COMBINE_KERNELS["wide"] else (rows,)
    kernel("mla.cu", name, **_defines(spec))(grid, (128,), (*args, o_latent))


def attend_splits(q_latent: cupy.ndarray, q: cupy.ndarray, cache: cupy.ndarray, spec: MLASpec, batch,
                  token_rows: cupy.ndarray | None, num_sms: int, absorbed_kernel: str | None = None,
                  q_pe_only: bool = False, latent_write: LatentWrite | None = None, most_splits: int | None = None
                  ) -> tuple[cupy.ndarray, SplitPartials | None]:
    """``absorbed_attention``'s attention kernel alone: ``o_latent`` (written only without splits, or combined in
    a cluster) and the splits' partials to combine (None: none left to combine); ``most_splits``: a cap on the
    context splits per token (None: the kernel's own count)."""
    num_tokens = int(q.shape[0])
    name = choose_absorbed_kernel(spec.num_heads, num_tokens, absorbed_kernel)
    if name == "tma" and not mla_decode_sm90.tma_decode_fits(spec, cache):
        name = "mma_shared" if spec.num_heads <= SHARED_HEADS else "mma"  # each one's measured fallback
    if name == "mma_shared" and not shared_decode_fits(spec):
        name = "mma"
    if name != "cuda_cores" and not mma_decode_fits(spec):
        name = "cuda_cores"
    if latent_write is not None and name != "tma":  # only the tma kernel writes the latents itself
        w = latent_write
        q = write_latent_q_pe(q, w.latent, cache, w.kv_a_norm, spec, batch, w.cos, w.sin, w.eps)
        q_pe_only, latent_write = True, None
    q_layout = (spec.qk_rope_dim, 0) if q_pe_only else (spec.qk_head_dim, spec.qk_nope_dim)  # q's head stride, q_pe
    blocks_of_16 = name == "mma16" or (name == "mma" and heads16())
    heads, lora = spec.num_heads, spec.kv_lora_rank
    o_latent = cupy.empty((num_tokens, heads, lora), dtype=cupy.uint16)
    cluster = 1  # the tma kernel's CTAs per cluster (tma_cluster)
    if name in ("mma_shared", "tma"):
        head_chunks = -(-heads // SHARED_HEADS)
    elif name in ("mma", "mma16"):
        head_chunks = mma_decode_head_chunks(heads, blocks_of_16)
    else:
        head_chunks = -(-heads // HEADS_PER_BLOCK)
    def capped(splits: int) -> int:  # the kernel's own split count within most_splits
        return min(splits, most_splits) if most_splits else splits

    if name == "mma_shared":  # 93 KB of shared memory per block of 32 keys: 2 per SM; 168 KB of 64: 1
        keys = shared_keys(num_tokens)
        splits = capped(resident_splits(num_tokens, head_chunks, num_sms, 2 if keys == 32 else 1))
    elif name == "tma":
        blocks_per_sm = mla_decode_sm90.tma_blocks_per_sm_of(spec, latent_write is not None)
        splits = capped(resident_splits(num_tokens, head_chunks, num_sms, blocks_per_sm))
        cluster = mla_decode_sm90.tma_cluster(spec, splits, num_tokens)
        balance_slots = 0
        if cluster > 1:
            splits = cluster  # a cluster's splits combine on chip into o_latent
        elif mla_decode_sm90.tma_balance():
            splits = max(splits, mla_decode_sm90.BALANCE_MIN_SPLITS)
            balance_slots = max(1, blocks_per_sm * num_sms // head_chunks)
        staged_q = mla_decode_sm90.q_tile(latent_write is not None) and mla_decode_sm90.q_tile_fits(spec, q, *q_layout)
        tma_attention, tma_smem = mla_decode_sm90.tma_decode_kernel(spec, cluster, latent_write is not None,
                                                                    staged_q)
    else:
        splits = capped(num_splits(num_tokens, head_chunks, num_sms))
    combined_on_chip = cluster > 1
    partial_o = partial_ml = NULL
    if splits > 1 and not combined_on_chip:
        partial_o = cupy.empty((num_tokens, heads, splits, lora), dtype=cupy.float32)
        partial_ml = cupy.empty((num_tokens, heads, splits, 2), dtype=cupy.float32)
    args = (q_latent, q, np.int32(q_layout[0]), np.int32(q_layout[1]), cache, batch.block_tables,
            np.int32(batch.block_tables.shape[1]), np.int32(cache.shape[1]), batch.query_start, np.int32(batch.num_seqs),
            batch.positions, np.int32(heads), np.float32(spec.scale), o_latent, np.int32(splits), partial_o,
            partial_ml, NULL if token_rows is None else token_rows)
    if name == "tma":
        write_args = (NULL, np.int32(0), NULL, np.float32(0), NULL, NULL, NULL, np.int32(0))
        if latent_write is not None:
            w = latent_write
            write_args = (w.latent, np.int32(w.latent.strides[0] // 2), w.kv_a_norm, np.float32(w.eps),
                          batch.slot_mapping, w.cos, w.sin, np.int32(q.strides[0] // 2))
        mla_decode_sm90.launch_tma_decode(tma_attention, tma_smem, (num_tokens, head_chunks, splits), args, cache,
                                          balance_slots, write_args=write_args)
    elif name == "mma_shared":
        attention, smem = _shared_decode_kernel(spec, keys)
        attention((num_tokens, head_chunks, splits), (SHARED_THREADS,), args, shared_mem=smem)
    elif name in ("mma", "mma16"):
        attention, smem = _mma_decode_kernel(spec, blocks_of_16)
        attention((num_tokens, head_chunks, splits), (MMA_DECODE_THREADS,), args, shared_mem=smem)
    else:
        kernel("mla.cu", "mla_attention", **_defines(spec))((num_tokens, head_chunks, splits), (MLA_THREADS,), args)
    return o_latent, SplitPartials(partial_o, partial_ml, splits) if splits > 1 and not combined_on_chip else None


def expand_small_fits(num_tokens: int, spec: MLASpec) -> bool:
    """Whether W_UV of ``num_tokens`` rows runs mla_expand_small ($OPENINFER_MLA_EXPAND_SMALL=1, at most
    EXPAND_SMALL_MAX_TOKENS rows, v in 16-column blocks, the latent in 4 x 16-dim steps). Row count only."""
    text = os.environ.get(EXPAND_SMALL_ENV) or "0"
    if text not in ("0", "1"):
        raise ValueError(f"{EXPAND_SMALL_ENV} is 0 or 1; got {text!r}")
    return (text == "1" and 0 < num_tokens <= EXPAND_SMALL_MAX_TOKENS and spec.v_head_dim % EXPAND_SMALL_COLUMNS == 0
            and spec.kv_lora_rank % 64 == 0)


def expand_values(blas: Cublas, o_latent: cupy.ndarray, w_uv: cupy.ndarray, spec: MLASpec, out: cupy.ndarray) -> None:
    """W_UV: ``out [T, H·v]`` from ``o_latent [T, H, lora]`` (one strided-batched GEMM, or mla_expand_small)."""
    num_tokens, heads, v, lora = int(o_latent.shape[0]), spec.num_heads, spec.v_head_dim, spec.kv_lora_rank
    if expand_small_fits(num_tokens, spec):
        kernel("mla.cu", "mla_expand_small", **_defines(spec))(
            (heads, v // EXPAND_SMALL_COLUMNS), (EXPAND_SMALL_THREADS,),
            (o_latent, w_uv, np.int32(num_tokens), np.int32(heads), out))
        return
    # o_h^T [v x T] = W_UV[h] [v x lora] . o_latent_h^T [lora x T]
    blas.matmul_strided_batched(True, False, v, num_tokens, lora, w_uv, lora, v * lora,
                                o_latent, heads * lora, lora, out, heads * v, v, heads)


def combine_expand_columns(num_tokens: int, splits: int, spec: MLASpec) -> int:
    """mla_combine_expand's columns per block for a step of ``num_tokens`` rows with ``splits`` context splits to
    combine ($OPENINFER_MLA_COMBINE_EXPAND: 0, 16, 32 or 64; unset: DEFAULT_COMBINE_EXPAND; another value: a clear
    error), or 0 where the combine and W_UV stay two launches: the switch off, no splits to combine, more than
    COMBINE_EXPAND_MAX_TOKENS rows, v not whole blocks of that many columns, the latent not 4 x 16-dim mma steps, or
    more than COMBINE_SHARED_MAX_SPLITS splits (their combine is the loop, other bits). Row and split counts only:
    graph-safe."""
    text = os.environ.get(COMBINE_EXPAND_ENV) or str(DEFAULT_COMBINE_EXPAND)
    if text not in ("0", *map(str, COMBINE_EXPAND_CHOICES)):
        raise ValueError(f"{COMBINE_EXPAND_ENV} is 0 (off) or the columns per block, "
                         f"{', '.join(map(str, COMBINE_EXPAND_CHOICES))}; got {text!r}")
    columns = int(text)
    fits = (columns and 1 < splits <= COMBINE_SHARED_MAX_SPLITS and 0 < num_tokens <= COMBINE_EXPAND_MAX_TOKENS
            and spec.v_head_dim % columns == 0 and spec.kv_lora_rank % 64 == 0)
    return columns if fits else 0


def combine_expand(partials: SplitPartials, o_latent: cupy.ndarray, w_uv: cupy.ndarray, spec: MLASpec,
                   out: cupy.ndarray, columns: int) -> None:
    """``mla_combine_expand``: ``out [T, H·v]`` from the splits' partials (and ``o_latent``'s rows written whole by
    their one split) through W_UV, ``columns`` (``combine_expand_columns``) output columns per block."""
    num_tokens, heads = int(partials.partial_ml.shape[0]), spec.num_heads
    threads = EXPAND_SMALL_THREADS * columns // EXPAND_SMALL_COLUMNS  # 4 warps per 16 columns
    kernel("mla.cu", "mla_combine_expand", **_defines(spec), COMBINE_EXPAND_COLUMNS=columns)(
        (heads, spec.v_head_dim // columns), (threads,),
        (partials.partial_o, partials.partial_ml, np.int32(partials.splits), o_latent, w_uv, np.int32(num_tokens),
         np.int32(heads), out))


def combine_expand_most_splits(num_tokens: int, spec: MLASpec) -> int | None:
    """The most context splits a token takes where mla_combine_expand would combine them (see COMBINE_EXPAND_ENV:
    heads x splits within $OPENINFER_MLA_COMBINE_EXPAND_HEAD_SPLITS, an integer >= 0, 0: no cap; at least 2), or
    None where there is no cap or the kernel would not run. Row count only: graph-safe."""
    if not combine_expand_columns(num_tokens, 2, spec):
        return None
    text = os.environ.get(COMBINE_EXPAND_HEAD_SPLITS_ENV) or str(COMBINE_EXPAND_HEAD_SPLITS)
    if not text.isdigit():
        raise ValueError(f"{COMBINE_EXPAND_HEAD_SPLITS_ENV} is an integer >= 0 (heads x context splits; 0: no cap); "
                         f"got {text!r}")
    return max(2, int(text) // spec.num_heads) if int(text) else None


def attend_and_expand(blas: Cublas, q_latent: cupy.ndarray, q: cupy.ndarray, cache: cupy.ndarray,
                      w_uv: cupy.ndarray, spec: MLASpec, batch, out: cupy.ndarray, token_rows: cupy.ndarray | None,
                      num_sms: int, absorbed_kernel: str | None = None, q_pe_only: bool = False,
                      latent_write: LatentWrite | None = None) -> None:
    """The absorbed step after W_UK: attention (``attend_splits``, the same arguments as ``absorbed_attention``;
    splits capped by ``combine_expand_most_splits``), then the split combine and W_UV into ``out [T, H·v]``, as one
    launch where ``combine_expand_columns`` says, else ``combine_splits`` and ``expand_values``."""
    o_latent, partials = attend_splits(q_latent, q, cache, spec, batch, token_rows, num_sms, absorbed_kernel,
                                       q_pe_only, latent_write,
                                       most_splits=combine_expand_most_splits(int(q.shape[0]), spec))
    columns = combine_expand_columns(int(o_latent.shape[0]), partials.splits if partials else 1, spec)
    if columns:
        combine_expand(partials, o_latent, w_uv, spec, out, columns)
        return
    if partials is not None:
        combine_splits(partials, o_latent, spec)
    expand_values(blas, o_latent, w_uv, spec, out)


def _absorbed(blas: Cublas, q: cupy.ndarray, cache: cupy.ndarray, w_uk: cupy.ndarray, w_uv: cupy.ndarray,
              spec: MLASpec, batch, out: cupy.ndarray, token_rows: cupy.ndarray | None, num_sms: int,
              absorbed_kernel: str | None = None) -> None:
    """Absorbed form for the rows of ``q`` (rope rotated), written to ``out``; ``token_rows``:
    each row's token in the step (None: row i is token i)."""
    q_latent = absorb_queries(blas, q, w_uk, spec)
    attend_and_expand(blas, q_latent, q, cache, w_uv, spec, batch, out, token_rows, num_sms, absorbed_kernel)


def gather_context(cache: cupy.ndarray, spec: MLASpec, batch, plan: PrefillPlan) -> tuple[cupy.ndarray, cupy.ndarray]:
    """``mla_gather_context``: the plan's sequences' whole contexts out of the paged cache, contiguous
    ``c_kv [C, lora]`` and ``k_pe [C, rope]``."""
    rows = plan.context_rows
    c_kv = cupy.empty((rows, spec.kv_lora_rank), dtype=cupy.uint16)
    k_pe = cupy.empty((rows, spec.qk_rope_dim), dtype=cupy.uint16)
    kernel("mla.cu", "mla_gather_context", **_defines(spec))((rows,), (128,), (
        cache, batch.block_tables, np.int32(batch.block_tables.shape[1]), np.int32(cache.shape[1]), plan.seqs,
        np.int32(plan.seqs.shape[0]), c_kv, k_pe))
    return c_kv, k_pe


def expand_context(blas: Cublas, c_kv: cupy.ndarray, w_uk: cupy.ndarray, w_uv: cupy.ndarray, spec: MLASpec
                   ) -> tuple[cupy.ndarray, cupy.ndarray]:
    """kv_b by cuBLAS: per-head keys ``k_nope [C, H·nope]`` and ``values [C, H·v]`` from ``c_kv``."""
    heads, lora, rows = spec.num_heads, spec.kv_lora_rank, int(c_kv.shape[0])
    k_nope = cupy.empty((rows, heads * spec.qk_nope_dim), dtype=cupy.uint16)
    values = cupy.empty((rows, heads * spec.v_head_dim), dtype=cupy.uint16)
    blas.matmul_nt(c_kv, w_uk.reshape(heads * spec.qk_nope_dim, lora), k_nope)
    blas.matmul_nt(c_kv, w_uv.reshape(heads * spec.v_head_dim, lora), values)
    return k_nope, values


def prefill_kernel(spec: MLASpec) -> str:
    """The decompressed prefill's attention kernel: $OPENINFER_MLA_PREFILL (a key of PREFILL_KERNELS), else
    DEFAULT_PREFILL_KERNEL; "wgmma" off Hopper or on a shape it does not take runs "pipelined", which
    needs nope + rope in 32-wide steps, else "plain" runs."""
    name = os.environ.get(PREFILL_KERNEL_ENV) or DEFAULT_PREFILL_KERNEL
    if name not in PREFILL_KERNELS:
        raise ValueError(f"{PREFILL_KERNEL_ENV} is one of {', '.join(PREFILL_KERNELS)}; got {name!r}")
    if name == "wgmma" and not (sm90_prefill_fits(spec) and _is_hopper(cupy.cuda.Device().id)):
        name = "pipelined"
    if name == "pipelined" and spec.qk_head_dim % 32:
        name = "plain"
    return name


def pipelined_prefill_smem(spec: MLASpec, tile: int) -> int:
    """mla_prefill_attention_pipelined's dynamic shared memory (mla.cu PIPE_PREFILL_SMEM): the query
    tile and two K and V tiles, rows padded by 8 bf16."""
    qk_row, v_row = spec.qk_head_dim + 8, spec.v_head_dim + 8
    return (tile * qk_row + 2 * PIPELINED_PREFILL_KEYS * (qk_row + v_row)) * 2


@dataclass(frozen=True)
class Sm90PrefillVariant:
    """mla_prefill_attention_sm90's compile-time choices (mla_prefill_sm90.cu's defines)."""

    keys: int  # BLOCK_N
    pingpong: bool
    split_kv: bool
    tma: bool  # TMA_KV_LOADS
    ordered: bool = False  # ORDERED_SOFTMAX


def sm90_prefill_variant() -> Sm90PrefillVariant:
    """$OPENINFER_MLA_SM90_KEYS (128 / 64), $OPENINFER_MLA_SM90_PINGPONG, _SPLIT_KV, _TMA and _ORDERED (0 / 1),
    else the defaults."""
    keys = os.environ.get(SM90_KEYS_ENV) or str(DEFAULT_SM90_KEYS)
    if keys not in ("128", "64"):
        raise ValueError(f"{SM90_KEYS_ENV} is 128 or 64; got {keys!r}")
    switches = []
    for env, default in ((SM90_PINGPONG_ENV, DEFAULT_SM90_PINGPONG), (SM90_SPLIT_KV_ENV, DEFAULT_SM90_SPLIT_KV),
                         (SM90_TMA_ENV, DEFAULT_SM90_TMA), (SM90_ORDERED_ENV, DEFAULT_SM90_ORDERED)):
        value = os.environ.get(env) or str(int(default))
        if value not in ("0", "1"):
            raise ValueError(f"{env} is 0 or 1; got {value!r}")
        switches.append(value == "1")
    return Sm90PrefillVariant(int(keys), *switches)


_tma_maps: dict[tuple[int, PageBoxLayout], np.ndarray] = {}
TMA_MAPS_KEPT = 256  # encoded maps kept (a map is its address and layout: the pool hands the same scratch back)


def _tma_box_map(array: cupy.ndarray, heads: int, keys: int) -> np.ndarray:
    """The tensor map of a contiguous ``[C, heads·width]`` bf16 array as (column, head, row), box 64 columns x
    1 head x ``keys`` rows (mla_prefill_sm90.cu's TMA_KV_LOADS), as a kernel argument; encoded once per
    (address, layout): the memory pool returns the same scratch address layer after layer."""
    rows, width = int(array.shape[0]), int(array.shape[1]) // heads
    layout = PageBoxLayout(dims=(width, heads, rows), strides=(width * 2, heads * width * 2),
                           box=(BOX_ELEMENTS, 1, keys))
    key = (int(array.data.ptr), layout)
    found = _tma_maps.get(key)
    if found is None:
        if len(_tma_maps) >= TMA_MAPS_KEPT:
            _tma_maps.clear()
        found = _tma_maps[key] = encode_page_map(*key).view(TENSOR_MAP_PARAM)
    return found


def sm90_prefill_smem(spec: MLASpec, keys: int) -> int:
    """mla_prefill_attention_sm90's dynamic shared memory (mla_prefill_sm90.cu SHARED_BYTES) with ``keys``
    per K / V tile: the Q tile and the K / V ring in 128-byte rows, its mbarriers and an 8-byte sink, 1024 bytes
    of alignment."""
    stages = SM90_PREFILL_STAGES[keys]
    q_tile = spec.qk_head_dim // 64 * PREFILL_KERNEL_TILE["wgmma"] * 128
    stage = (spec.qk_head_dim + spec.v_head_dim) // 64 * keys * 128
    return q_tile + stages * stage + 8 * (1 + 4 * stages) + 8 + 1024


def prefill_attention(q: cupy.ndarray, k_nope: cupy.ndarray, k_pe: cupy.ndarray, values: cupy.ndarray, spec: MLASpec,
                      plan: PrefillPlan, out: cupy.ndarray) -> None:
    """Causal flash attention of the plan's query tiles over their expanded contexts, into their rows
    of ``out [T, H·v]`` (the kernel the plan was laid out for: ``prefill_kernel``'s)."""
    grid = (int(plan.tile_seq.shape[0]), spec.num_heads)
    args = (q, k_nope, k_pe, values, plan.seqs, plan.tile_seq, plan.tile_query, np.int32(spec.num_heads))
    if plan.kernel == "plain":
        kernel("mla.cu", PREFILL_KERNELS["plain"], **_defines(spec))(grid, (PREFILL_THREADS,),
                                                                     (*args, np.float32(spec.scale), out))
        return
    if plan.kernel == "wgmma":
        variant = sm90_prefill_variant()
        tma = variant.tma and spec.qk_nope_dim % BOX_ELEMENTS == 0 and spec.qk_rope_dim % BOX_ELEMENTS == 0
        smem = sm90_prefill_smem(spec, variant.keys)
        attention = arch_kernel("mla_prefill_sm90.cu", PREFILL_KERNELS["wgmma"], "sm_90a", smem,
                                NOPE_DIM=spec.qk_nope_dim, ROPE_DIM=spec.qk_rope_dim, V_DIM=spec.v_head_dim,
                                BLOCK_N=variant.keys, STAGES=SM90_PREFILL_STAGES[variant.keys],
                                PINGPONG=int(variant.pingpong), SPLIT_KV=int(variant.split_kv), TMA_KV_LOADS=int(tma),
                                ORDERED_SOFTMAX=int(variant.ordered), SM90A_TARGET=1)
        maps = ((_tma_box_map(k_nope, spec.num_heads, variant.keys), _tma_box_map(k_pe, 1, variant.keys),
                 _tma_box_map(values, spec.num_heads, variant.keys)) if tma else (NULL, NULL, NULL))
        attention(grid, (SM90_PREFILL_THREADS,), (*args, np.float32(spec.scale * LOG2E), out, *maps), shared_mem=smem)
        return
    smem = pipelined_prefill_smem(spec, PREFILL_KERNEL_TILE[plan.kernel])
    attention = kernel("mla.cu", PREFILL_KERNELS["pipelined"], **_defines(spec))
    if isinstance(attention, cupy.RawKernel) and id(attention) not in _smem_set:
        attention.max_dynamic_shared_size_bytes = smem
        _smem_set[id(attention)] = attention
    attention(grid, (PREFILL_THREADS,), (*args, np.float32(spec.scale), out), shared_mem=smem)


def _decompressed(blas: Cublas, q: cupy.ndarray, cache: cupy.ndarray, w_uk: cupy.ndarray, w_uv: cupy.ndarray,
                  spec: MLASpec, batch, plan: PrefillPlan, out: cupy.ndarray) -> None:
    """Decompressed form for the plan's sequences (q's rope dims already rotated)."""
    c_kv, k_pe = gather_context(cache, spec, batch, plan)
    k_nope, values = expand_context(blas, c_kv, w_uk, w_uv, spec)
    prefill_attention(q, k_nope, k_pe, values, spec, plan, out)
