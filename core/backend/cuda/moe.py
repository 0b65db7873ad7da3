"""MoE and quantized linears on the GPU (kernels in ``openinfer/kernels/moe.cu``).

Expert weights of one layer live stacked per projection, ``[E, N, K]`` rows with K contiguous,
in their checkpoint format — bf16, INT4 pack-quantized (int32 words + bf16 group scales) or FP8
e4m3 (+ fp32 block ``scale_inv``) — and are dequantised tile by tile inside the grouped GEMM::

    ExpertLinear.data   [E, N, K] bf16 | [E, N, K/8] int32 | [E, N, K] uint8
    ExpertLinear.scale  None         | [E, N, K/group] bf16 | [E, ⌈N/b⌉, ⌈K/b⌉] fp32
    ExpertLinear.expert(e)  a view of expert e (expert parallelism hands ranks slices)

INT4 weights with group-32 scales may instead live in the decode GEMV's tiled layout
(``layout="tiled"``, core/quant.py ``tile_int4``: 16 rows x 128 weights per contiguous 1 KB chunk),
which every kernel here reads (moe.cu INT4_TILED); ``upload_expert_linear`` tiles them when
$OPENINFER_INT4_LAYOUT (default ``tiled`` since E1 of 2026-11-24; ``rows``: the checkpoint layout;
``lane_groups``, the default since D2 of 2026-11-24: the tiled layout with a lane's 16 bytes one whole group,
for moe_int4.cu's GEMV).

A dense quantized linear (FP8 attention projections, say) is an ``ExpertLinear`` with E = 1.
Which kernel multiplies depends on the weight format and how many rows share each weight
(thresholds measured on an H100, ``benchmarks/gpu_kimi.py gemv`` / ``kernels``; the decode GEMV
is chosen in one place, ``choose_gemv``, and OPENINFER_MOE_GEMV forces one)::

    rows per weight     dense (E = 1)                          grouped (experts)
    few (decode)        a decode GEMV, weights read once       a decode GEMV over moe_sort's tiles
                        straight from FP8 / INT4: moe_gemv,    (INT4: moe_gemv_mma on tensor cores,
                        moe_gemv_wide (FP8: up to 4 rows)      bf16: moe_gemv_wide, FP8: moe_gemv)
    middle              moe_grouped_gemm dense mode            moe_grouped_gemm (bf16: moe_pipelined.cu's
                                                               moe_grouped_gemm_pipelined, gate_up fused
                                                               with SiLU·mul; see PIPELINED_ENV)
    many (prefill)      moe_dequantize → bf16 scratch → cuBLAS cuBLAS per active expert (bf16 as stored,
                                                               else moe_dequantize'd) after one host
                                                               read of the per-expert row counts
                                                               (BLAS_ENV=0: as in the middle row)

On a Hopper GPU (default; OPENINFER_MOE_SM90=0: the table above) bf16 experts' middle and many rows
(above ``moe_sm90.SM90_ABOVE_ROWS_PER_EXPERT`` slots per expert) go to moe_sm90.cu's persistent
wgmma kernel (gate_up fused with SiLU·mul in ``moe_forward``): no host read, capturable.

Routing runs on the device too (``moe_route``), so a decode step never waits for the host and can
be captured in a CUDA graph; only big eager steps (prefill, ``BLAS_MIN_ROWS_PER_EXPERT``) read the
routing's counts back, where cuBLAS on each expert's rows is worth a sync per layer.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass

import cupy
import numpy as np

from openinfer.backend.cuda.linear import gemv_beside_other_work, sm_count
from openinfer.backend.cuda.loader import kernel
from openinfer.backend.cuda.moe_routing import (
    MAX_EXPERTS,
    MAX_TOPK,
    NULL,
    ExpertGroupingDevice,
    _switch,
    fast_routing,
    group_by_expert,
    route,
    route_and_group,
    route_decode_ticket,
    route_decode_wanted,
    route_sort_wanted,
)
from openinfer.backend.cuda.moe_sm90 import grouped_gemm_sm90, rotated_units, sm90_experts, sm90_pdl
from openinfer.backend.cuda.pdl_launch import launch
from openinfer.moe import RouterSpec
from openinfer.quant import int4_tiling_fits, tile_int4

FORMATS = {"bf16": 0, "int4": 1, "fp8": 2}
TILE_M, TILE_N = 64, 64  # BM, BN in moe.cu
GEMM_THREADS = 128
GEMV_ROWS, GEMV_WARPS = 8, 8  # moe.cu
WEIGHT_CHUNK = {"bf16": 8, "int4": 32, "fp8": 16}  # weights per 16-byte load in moe_gemv
# H100, Kimi-K2 shapes (benchmarks/results/kimi_kernels.json): dense FP8 7168x8192 / INT4 4096x7168,
# moe_gemv beat the scratch + cuBLAS path up to 8 rows (FP8: 0.137 vs 0.132 ms at 8, INT4 0.081 vs
# 0.088), which beat the per-tile dequantising GEMM at every row count (3-9x); 384 INT4 experts
# top-8: moe_gemv ahead at 1.3 slots per expert (5.96 vs 9.83 ms), behind at 5.3 (17.7 vs 12.8 ms).
GEMV_MAX_ROWS = 8  # dense linears with at most this many rows take moe_gemv
GEMV_MAX_ROWS_PER_EXPERT = 3  # grouped: moe_gemv while the slots average at most this per expert
# On by default since E3 (H200, 2026-11-24; OPENINFER_MOE_BLAS=0 turns it off): grouped, eager steps whose
# slots average at least this many per expert take cuBLAS per active expert (moe_grouped_gemm peaks near
# 75 TFLOP/s). Moonlight served (bf16 64 x top-6, results/moonlight_ours_optin_e3_h200.json): 8k-token
# mixed steps ~300 -> ~150-170 ms; a lone 1k-token prompt (96 slots per expert) went 58 -> 163 ms (a
# host read of the counts per layer), hence the bound: an 8k step has 768. Never while a CUDA graph is
# being captured (the counts are read on the host).
BLAS_MIN_ROWS_PER_EXPERT = 512
BLAS_ENV = "OPENINFER_MOE_BLAS"
# Decode GEMV kernels: moe_gemv (one column per warp), moe_gemv_wide (several columns per warp, next
# chunk's loads in flight, no int->float conversions; moe.cu) in two shapes, moe_gemv_mma (tensor
# cores, 16 columns per warp, 16 rows per pass over the weights). Name -> moe.cu defines.
GEMV_KERNEL_ENV = "OPENINFER_MOE_GEMV"  # force one kernel wherever a decode GEMV runs ("auto": the tables)
GEMV_KERNELS: dict[str, dict[str, int]] = {
    "moe_gemv": {},
    "wide": {"WIDE_COLUMNS": 4, "WIDE_ROWS": 4, "WIDE_MIN_BLOCKS": 3},  # 12 warps per SM (INT4: 166 registers)
    "wide2": {"WIDE_COLUMNS": 2, "WIDE_ROWS": 4, "WIDE_MIN_BLOCKS": 4},  # 16 warps per SM
    # sm_90a ptxas: 80 / 50 / 72 registers for INT4 / bf16 / FP8, no spills
    "mma": {"MMA_GEMV_NTILES": 2},
    # the same with more chunks in flight per lane (a ring of MMA_GEMV_DEPTH; "mma" has 2): a batch-1
    # step has few warps per SM, so HBM sees only their loads. Opt-in until measured. sm_90a ptxas,
    # INT4: 96 / 126 / 168 registers at depth 3 / 4 / 8 (72 at 2), no spills
    "mma_depth3": {"MMA_GEMV_NTILES": 2, "MMA_GEMV_DEPTH": 3},
    "mma_depth4": {"MMA_GEMV_NTILES": 2, "MMA_GEMV_DEPTH": 4},
    "mma_depth8": {"MMA_GEMV_NTILES": 2, "MMA_GEMV_DEPTH": 8},
    # split K (opt-in until measured): the block's 4 warps share fewer columns, each over a slice of K,
    # summed through shared memory, so a batch-1 step (8 experts x N/64 blocks: ~16 warps per SM) runs
    # 2-4x the warps and as many 16-row weight streams at once; "mma1": one n-tile (8 rows per pass,
    # fewer registers) for the smallest steps. sm_90a ptxas, INT4: 72 / 80 / 96 / 72 registers, no spills
    "mma_split2": {"MMA_GEMV_NTILES": 2, "MMA_GEMV_KSPLIT": 2},
    "mma_split4": {"MMA_GEMV_NTILES": 2, "MMA_GEMV_KSPLIT": 4},
    "mma_split4_depth3": {"MMA_GEMV_NTILES": 2, "MMA_GEMV_KSPLIT": 4, "MMA_GEMV_DEPTH": 3},
    "mma1_split4": {"MMA_GEMV_NTILES": 1, "MMA_GEMV_KSPLIT": 4},
    # split K with deeper rings, for bf16 dense projections of 2-32 rows (the kimi plugin's OPENINFER_KIMI_DENSE_GEMV,
    # opt-in until measured): a 16-row pass over Moonlight's q / kv_a (3648 x 2048) runs 228 blocks of 4 warps, each
    # warp 1 KB of weights per chunk, so 4-8 chunks in flight per warp keep ~4-7 MB of reads in flight
    "mma_split4_depth4": {"MMA_GEMV_NTILES": 2, "MMA_GEMV_KSPLIT": 4, "MMA_GEMV_DEPTH": 4},
    "mma_split4_depth8": {"MMA_GEMV_NTILES": 2, "MMA_GEMV_KSPLIT": 4, "MMA_GEMV_DEPTH": 8},
    # INT4 with group-32 scales (Kimi's experts), opt-in until measured: moe_gemv_mma_staged, each
    # warp's weights copied to shared memory by cp.async in runs of STAGED_CHUNKS x 64 contiguous
    # bytes per row (moe_gemv_mma's lanes read 64 bytes of a row per load; the H100's INT4 and bf16
    # mma GEMVs reached 43-50 % of the copy bandwidth at one token where bf16 moe_gemv_wide, 512-byte
    # row runs, reached 87 %); other formats and shapes run moe_gemv_mma. sm_90a ptxas: 126 / 96
    # registers, 46 / 42 KB shared, no spills
    "mma_staged": {"MMA_GEMV_NTILES": 2, "STAGED_CHUNKS": 4, "STAGED_STAGES": 2},
    "mma_staged2x3": {"MMA_GEMV_NTILES": 2, "STAGED_CHUNKS": 2, "STAGED_STAGES": 3},
    # weight loads past L1 with 256-byte L2 lines (GEMV_STREAM_LOADS: ld.global.nc.L1::no_allocate.L2::256B,
    # cp.async .L2::256B), opt-in until measured: E1 (H200) took the tiled GEMV's batch-1 gate_up 106 -> 81 us
    "mma_nc": {"MMA_GEMV_NTILES": 2, "GEMV_STREAM_LOADS": 1},
    "mma_staged_nc": {"MMA_GEMV_NTILES": 2, "STAGED_CHUNKS": 4, "STAGED_STAGES": 2, "GEMV_STREAM_LOADS": 1},
    "wide_nc": {"WIDE_COLUMNS": 4, "WIDE_ROWS": 4, "WIDE_MIN_BLOCKS": 3, "GEMV_STREAM_LOADS": 1},
    # one token row per pass (WIDE_ROWS 1: fewer registers, more resident blocks) and 8 or 4 columns per warp,
    # streaming loads, opt-in until measured: a batch-1 step has ~0.1 slots per expert, and wide_nc's 108
    # registers (4 rows) leave 4 blocks per SM, so Moonlight's gate_up (1056 blocks) and down (768) ran in
    # 2 and 1.5 waves. sm_90a ptxas, bf16: 99 / 84 registers (5 / 6 blocks per SM; gate_up 528 / 1056 blocks).
    # E1 (H200, results/kimi_gemv_tiled_s8e1.json, 1 token): gate_up 20.3 / 22.0 vs wide_nc 19.9 us, down 11.5 /
    # 14.4 vs 13.3: wide8_r1_nc ahead on the down projection only (not in the table: one choice per format)
    "wide8_r1_nc": {"WIDE_COLUMNS": 8, "WIDE_ROWS": 1, "WIDE_MIN_BLOCKS": 4, "GEMV_STREAM_LOADS": 1},
    "wide4_r1_nc": {"WIDE_COLUMNS": 4, "WIDE_ROWS": 1, "WIDE_MIN_BLOCKS": 4, "GEMV_STREAM_LOADS": 1},
    # INT4 in the tiled layout (ExpertLinear.layout "tiled", opt-in): moe_gemv_int4_tiled, a warp's 16 rows
    # one contiguous stream, the group scales applied after the mma (a shift and a lop3 per weight pair,
    # where moe_gemv_mma spends four); TILED_DEPTH chunks of 1 KB in flight per warp. Checkpoint-layout
    # weights run moe_gemv_mma instead. Unmeasured. sm_90 ptxas: 111 / 128 / 90 / 120 registers, no spills
    # (at most 128: 4 blocks per SM, a batch-1 gate_up's 512 blocks in one wave)
    "tiled": {"TILED_NTILES": 2, "TILED_DEPTH": 4},
    "tiled_depth6": {"TILED_NTILES": 2, "TILED_DEPTH": 6},
    "tiled1": {"TILED_NTILES": 1, "TILED_DEPTH": 4},
    "tiled1_depth6": {"TILED_NTILES": 1, "TILED_DEPTH": 6},
    # the same with ld.global.nc.L1::no_allocate.L2::256B weight loads (read once: past L1, whole lines)
    "tiled_nc": {"TILED_NTILES": 2, "TILED_DEPTH": 4, "TILED_STREAM_LOADS": 1},
    # the ring in shared memory (TILED_STAGES chunks of 1.5 KB per warp, cp.async, each lane its own bytes):
    # deeper than registers allow. sm_90 ptxas: 80 / 84 / 70 registers, 36 / 48 / 36 KB, no spills
    "tiled_s6": {"TILED_NTILES": 2, "TILED_STAGES": 6},
    "tiled_s8": {"TILED_NTILES": 2, "TILED_STAGES": 8},
    "tiled1_s6": {"TILED_NTILES": 1, "TILED_STAGES": 6},
    # each warp starting its chunk stream at its own place (TILED_ROTATE; E1's tiled GEMVs trailed the
    # checkpoint layout's, maybe lockstep warps reading addresses a row block's stride apart)
    "tiled1_nc_rot": {"TILED_NTILES": 1, "TILED_DEPTH": 4, "TILED_STREAM_LOADS": 1, "TILED_ROTATE": 1},
    "tiled_s6_rot": {"TILED_NTILES": 2, "TILED_STAGES": 6, "TILED_ROTATE": 1},
    # tiled1_nc_rot with 6 chunks in flight per warp (sm_90a ptxas: 126 registers, no spills; 4 blocks per SM:
    # a batch-1 gate_up's 512 blocks still in one wave), opt-in: E1 (H200, results/kimi_gemv_tiled_s8e1.json, 1
    # token) gate_up 66.8 vs 58.4 us, down 40.5 vs 36.3 (slower; so is _rb2: 142.2 / 53.7)
    "tiled1_nc_rot_d6": {"TILED_NTILES": 1, "TILED_DEPTH": 6, "TILED_STREAM_LOADS": 1, "TILED_ROTATE": 1},
    # ... each warp walking 2 row blocks (32 rows) as one chunk stream (TILED_ROW_BLOCKS): half the warps, each
    # twice as long (a batch-1 down projection's 896 blocks of 16-row warps took two waves), opt-in until
    # measured. sm_90a ptxas: 126 registers, no spills
    "tiled1_nc_rot_d6_rb2": {"TILED_NTILES": 1, "TILED_DEPTH": 6, "TILED_STREAM_LOADS": 1, "TILED_ROTATE": 1,
                             "TILED_ROW_BLOCKS": 2},
    # moe_gemv_int4_tiled_pair (TILED_PAIR): two 16-row blocks per warp side by side over one walk of K, the
    # activation fragments and the -136 mma built once for both (fewer instructions per weight byte: the
    # batch-1 tiled GEMV issues ~275 per 1 KB chunk), a ring of 3 chunk pairs. Opt-in: E1 (H200, 1 token)
    # gate_up 63.1 vs tiled1_nc_rot's 58.4 us, down 37.5 vs 36.3 (half the warps: slower).
    # sm_90a ptxas: 173 registers, no spills
    "tiled2_nc_rot": {"TILED_PAIR": 1, "TILED_NTILES": 1, "TILED_DEPTH": 3, "TILED_STREAM_LOADS": 1,
                      "TILED_ROTATE": 1},
    # INT4 in the lane-groups layout (ExpertLinear.layout "lane_groups", the default layout): moe_int4.cu
    # moe_gemv_int4_groups, the mma's N columns carrying a chunk's 4 groups (a lane's 16 bytes one whole
    # group), so the group scales take 4 FMAs per lane per 1 KB chunk; GROUPS_PAIRS token pairs per pass over
    # the weights, a ring of GROUPS_DEPTH chunks in registers; weights in other layouts run moe_gemv_mma instead.
    # sm_90a SASS of the steady loop at 1 token: 135 / 137 instructions per KB (groups / groups_d2;
    # tiled1_nc_rot: ~275, moe13c's count); ptxas: 128 registers (4 blocks per SM), no spills in the loop;
    # d6 and p2 at 3 blocks per SM (168 registers for the ring of 6)
    "groups": {"GROUPS_DEPTH": 4},
    "groups_d2": {"GROUPS_DEPTH": 2},
    "groups_d6": {"GROUPS_DEPTH": 6, "GROUPS_MIN_BLOCKS": 3},
    "groups_p2": {"GROUPS_DEPTH": 2, "GROUPS_PAIRS": 2, "GROUPS_MIN_BLOCKS": 3},
    "groups_norot": {"GROUPS_DEPTH": 4, "GROUPS_ROTATE": 0},
    # ... a chunk's 16 mma in 2 / 4 independent accumulator chains (GROUPS_ACC_CHAINS: the -136 mma apart, and by
    # step parity), summed at the chunk's end: a warp's dependent mma latency per chunk halved / quartered; fp32
    # rounding apart from one chain. Opt-in until measured (OPENINFER_MOE_GEMV=groups_norot_acc2 forces it).
    "groups_norot_acc2": {"GROUPS_DEPTH": 4, "GROUPS_ROTATE": 0, "GROUPS_ACC_CHAINS": 2},
    "groups_acc2": {"GROUPS_DEPTH": 4, "GROUPS_ACC_CHAINS": 2},
    "groups_norot_acc4": {"GROUPS_DEPTH": 4, "GROUPS_ROTATE": 0, "GROUPS_ACC_CHAINS": 4},
    # the chunk ring in shared memory, GROUPS_STAGES deep (cp.async; D1: the register ring's 3 chunks in flight
    # per warp left the batch-1 GEMVs at 59-74 % of HBM): 161 instructions per KB, 86 registers, 40 KB per block.
    # Opt-in, slower: D2 (H200, results/kimi_gemv_int4d_d2_h200.json) gate_up / down at 1 token 49.6 / 32.8 (s8), 52.9 / 33.6
    # (s8_norot), 57.7 / 29.7 (s6) vs groups_norot 42.4 / 26.2 us; s8_k2 55.2 / 34.4; s8_p2 / s8_p4 at 256 tokens
    # 5242 / 4871 and 2355 / 2437 vs the tiled layout's tiled1_nc_rot 3231 / 1323
    "groups_s8": {"GROUPS_STAGES": 8},
    "groups_s8_norot": {"GROUPS_STAGES": 8, "GROUPS_ROTATE": 0},
    "groups_s6": {"GROUPS_STAGES": 6},
    # ... with K split over the 2 warps sharing a row block (summed in shared memory): twice the warps, each half as
    # long (a batch-1 down projection's 896 blocks of 4 row blocks took 1.4 waves)
    "groups_s8_k2": {"GROUPS_STAGES": 8, "GROUPS_KSPLIT": 2},
    # ... with 2 / 4 token pairs per pass over the weights (4 / 8 rows per expert tile without re-streaming it;
    # for a few slots per expert): 244 / 365 instructions per KB, 102 / 128 registers
    "groups_s8_p2": {"GROUPS_STAGES": 8, "GROUPS_PAIRS": 2},
    "groups_s8_p4": {"GROUPS_STAGES": 8, "GROUPS_PAIRS": 4},
    # (A ring filled by TMA bulk copies, GROUPS_BULK, lane 0 of a warp issuing cp.async.bulk onto mbarriers, was slower
    # in s13 D2 at one token: gate_up / down 52.2 / 28.0 us with 4 stages, 53.4 / 33.8 with 8, vs groups_norot 42.2 /
    # 26.3, its memory stream alone 37.5 / 24.6 vs the register ring's 34.9 / 20.4; deleted.)
    # the pass's activations staged by the block in shared memory as the mma's B registers beside each group's sum
    # (GROUPS_XSMEM 2 / 1: two / one token rows a pass; no byte permutes in the loop, one -136 mma a chunk instead of
    # eight: 9 mma per KB instead of 16); register ring. sm_90a ptxas: 118-127 registers (4 blocks per SM), no spills;
    # dynamic shared memory (4 rows K / 128 + 1) x 80 bytes (Kimi-K2 gate_up 35.9 / 18.0 KB). s13 D2 (H200, one token,
    # results/kimi_gemv_int4_s13d1_h200.json) gate_up / down 37.8 / 23.9 us (xs1 37.8 / 23.8) vs groups_norot 42.2 /
    # 26.3: LANE_GROUPS_ONE_TOKEN and LANE_GROUPS_CHOICE's first entry
    "groups_xs": {"GROUPS_XSMEM": 2, "GROUPS_ROTATE": 0},
    "groups_xs_d2": {"GROUPS_XSMEM": 2, "GROUPS_ROTATE": 0, "GROUPS_DEPTH": 2},
    "groups_xs1": {"GROUPS_XSMEM": 1, "GROUPS_ROTATE": 0},
    # groups_xs with a warp's column blocks as one chunk stream (GROUPS_ROW_STREAM; R column blocks a block by
    # INT4_ROW_BLOCKS_ENV, "auto" unless set): Kimi-K2's batch-1 down projection (112 column blocks x 8 tiles = 896
    # blocks where 132 SMs hold 528: 1.7 waves of 16-chunk walks, each block staging its activations and filling its
    # ring) runs as one wave of 448 blocks, each warp one walk of 32 chunks; gate_up (one wave) and the fused
    # SiLU·mul form as groups_xs. LANE_GROUPS_ONE_TOKEN since s15 D1.
    "groups_xs_rs": {"GROUPS_XSMEM": 2, "GROUPS_ROTATE": 0, "GROUPS_ROW_STREAM": 1},
    # (With the warp asking L2 for the chunk 6 / 12 past each one the register ring loads, GROUPS_L2_PREFETCH
    # (prefetch.global.L2, 3 a lane a chunk), slower in s15 D1 (H200, Kimi-K2 layer b1, graph, alternated;
    # results/kimi_layer_b1_s15d1_h200.json): 184.8 / 184.7 (groups_xs_pf6), 187.0 / 187.3 (pf12), 182.5 / 182.1
    # (rs_pf6), 183.9 / 183.9 us (rs_pf12) vs groups_xs_rs 173.1 / 172.7; deleted.)
    # (Read at their mma, GROUPS_XSMEM_AT_USE: 93 / 80 registers, 5 / 6 blocks an SM; slower in s13 D3: gate_up / down
    # 38.9 / 24.9 and, ring of 2, 42.4 / 27.0 us vs 37.8 / 24.0; deleted.)
    # (Without the chunk walk's wrap test when unrotated, GROUPS_LINEAR_WALK, 97 -> 90 SASS instructions per KB: within
    # noise in s13 D3b, 38.2 / 23.8 vs 37.8 / 23.8 us, layer in_model 182.5 / 182.8 vs 182.6 / 182.7; deleted.)
    # measuring only, wrong results (moe_int4.cu GROUPS_PROBE): groups_norot's memory stream without the arithmetic,
    # its arithmetic on cache-resident chunks. s13 D2 (one token, gate_up / down): 34.9 / 20.4 and 38.2 / 21.3 us
    # where the kernel took 42.2 / 26.3: the arithmetic, not the loads, set the pace
    "probe_memory": {"GROUPS_DEPTH": 4, "GROUPS_ROTATE": 0, "GROUPS_PROBE": 1},
    "probe_arith": {"GROUPS_DEPTH": 4, "GROUPS_ROTATE": 0, "GROUPS_PROBE": 2},
}
TENSOR_CORE_GEMVS = tuple(name for name, defines in GEMV_KERNELS.items() if "MMA_GEMV_NTILES" in defines)
TILED_GEMVS = tuple(name for name, defines in GEMV_KERNELS.items() if "TILED_NTILES" in defines)
GROUPS_GEMVS = tuple(name for name, defines in GEMV_KERNELS.items()
                     if any(define.startswith("GROUPS_") for define in defines))
# The decode GEMVs of each INT4 layout's own (the others read it a word at a time, or not at all)
LAYOUT_GEMVS = {"tiled": TILED_GEMVS, "lane_groups": GROUPS_GEMVS}
# What tiled INT4 weights run wherever the tables pick a decode GEMV (unless one is forced): the other
# kernels read that layout a word at a time. tiled1_nc_rot: the fastest tiled kernel at 1 and 16 tokens in
# E2 (H200, results/kimi_gemv_e2_h200.json: gate_up 57.8 / 654 us vs tiled_nc 80.9 / 1015, down 36.4 / 337
# vs 48.5 / 657; the checkpoint layout's mma_staged 74.8 / 818 and 43.5 / 447).
TILED_GEMV = "tiled1_nc_rot"
# What lane-groups INT4 weights run wherever the tables pick a decode GEMV: the first entry whose bound holds
# (slots per expert; dense: rows), past the last the table's own choice (a pass of moe_gemv_int4_groups takes 2
# token rows: more rows per expert re-stream the weights; moe_gemv_mma reads the layout 16 bytes per lane).
# D1 of 2026-11-24 (H200, results/kimi_gemv_int4d_d1_h200.json; Kimi-K2 gate_up / down, tiled layout's
# tiled1_nc_rot first): 1 token 58.2 / 36.6 -> groups 44.1 / 26.8, groups_norot 42.0 / 26.1 us; 16 tokens
# 652 / 337 -> 510 / 277, 485 / 266; 64 tokens 1776 / 860 -> 1632 / 850, 1852 / 836; 256 tokens 3260 / 1283 ->
# 5260 / 2667 (moe_gemv_mma there, in the layer: 3166 / 1590). D2 (same sweep): 1 token 58.4 / 36.4 -> 44.6 / 26.3,
# 42.4 / 26.2; 16 tokens 653 / 334 -> 508 / 275, 516 / 267; 64 tokens 1785 / 853 -> 1693 / 878, 1650 / 867.
# s12 D2b (H200, one Kimi-K2 layer at 64 tokens, results/kimi_layer_b64_kimi13_d2b.json): groups_acc2 (the chunk's
# mma in two accumulator chains) 2,629.5 -> 2,582.7 us (gate_up 1,531.5 -> 1,512.0, down 834.4 -> 815.3); at one token
# groups_norot_acc2 was not faster (gate_up 43.5 -> 44.7 us), so the first entry stays.
# The first entry groups_xs since s13 D3b (H200, results/kimi_gemv_int4_s13d3b_h200.json): gate_up / down at 16 tokens
# (0.33 slots per expert) 524.3 / 267.7 -> 443.7 / 236.5 us, at one token 42.1 / 26.1 -> 37.8 / 23.8.
LANE_GROUPS_CHOICE: tuple[tuple[float, str], ...] = ((0.5, "groups_xs"), (3, "groups_acc2"))
# What lane-groups INT4 weights run in a grouped step of one token (every expert tile one row: a batch-1 decode step),
# ahead of LANE_GROUPS_CHOICE (which also picks groups_xs up to 0.5 slots per expert since D3b; this one holds for a
# single token whatever its slots per expert); None: the table's. groups_xs since s13 D2 (H200, results/kimi_gemv_int4_s13d1_h200.json,
# kimi_layer_b1_int4_s13d1_h200.json; Kimi-K2 at one token): gate_up / down 42.2 / 26.3 -> 37.8 / 23.9 us alone (the
# arithmetic alone, probe_arith, had been 38.2 / 21.3; the loads alone, probe_memory, 34.9 / 20.4); in the layer's
# graph timeline 43.6 + 25.9 -> 39.1 + 22.9 us (groups_xs1, the same kernel for one-row tiles), span 197.8 -> 190.3 us.
# Confirmed in s13 D3 (results/kimi_layer_b1_int4_s13d3_h200.json, alternated): layer b1 spans 187.7 / 187.4 vs
# groups_norot's 195.5 / 194.8 us, int4 GEMVs 38.8 + 22.7 vs 43.2 + 25.6.
# groups_xs_rs since s15 D1 (H200, results/kimi_layer_b1_s15d1_h200.json, one process, alternated A B ... B A): layer
# b1 graph 173.1 / 172.7 vs groups_xs' 174.6 / 174.8 us; the down projection alone 23.3 / 23.3 vs 24.4 / 24.5 us (one
# wave of 448 blocks instead of 1.7 waves of 896), gate_up alike (40.8 / 39.9 vs 40.4 / 40.2).
LANE_GROUPS_ONE_TOKEN: str | None = "groups_xs_rs"
# ... and for gate_up with SiLU·mul fused (gemv_silu_kernel; a batch-1 step's gate_up): None, the same
LANE_GROUPS_ONE_TOKEN_FUSED: str | None = None
# OPENINFER_INT4_ROW_BLOCKS (moe_int4.cu GROUPS_ROW_BLOCKS): each block of moe_gemv_int4_groups takes R column
# blocks in turn (blockIdx.x, + gridDim.x, ...), the grid R times narrower. "auto": for decode-sized grids (at most
# ROW_BLOCKS_MAX_TILES tile rows) that exceed one wave of resident blocks by a quarter or more, R = the waves
# (at most ROW_BLOCKS_MOST): Kimi-K2's batch-1 down projection (112 column blocks x 9 tile rows = 1,008 blocks
# where 132 SMs hold 528: 1.9 waves of 16-chunk walks) runs as one wave of 32-chunk walks; gate_up (576) stays.
# An integer forces R; unset or 1: off. Opt-in until measured on the device.
INT4_ROW_BLOCKS_ENV, ROW_BLOCKS_MAX_TILES, ROW_BLOCKS_MOST = "OPENINFER_INT4_ROW_BLOCKS", 16, 4
DEFAULT_INT4_ROW_BLOCKS = "1"


GROUPS_XSMEM_RECORD, GROUPS_STAGE_BYTES = 80, 1280  # moe_int4.cu: a staged (chunk, group, token) record; a ring stage
SHARED_BYTES_DEFAULT, SHARED_BYTES_MOST = 48 * 1024, 227 * 1024  # a block's shared memory without / with the opt-in


def groups_shared_bytes(defines: dict[str, int], in_features: int) -> tuple[int, int]:
    """(static, dynamic) shared memory of moe_gemv_int4_groups built with ``defines`` over K = ``in_features``: the
    shared-memory ring's stages, the split's partial sums; GROUPS_XSMEM's staged activations (two token rows' records,
    or one row's, and a zero record). More than a block may hold: a clear error."""
    warps, ksplit = MMA_GEMV_WARPS, defines.get("GROUPS_KSPLIT", 1)
    static = (warps * defines.get("GROUPS_STAGES", 0) * GROUPS_STAGE_BYTES
              + (warps * defines.get("GROUPS_PAIRS", 1) * 4 * 32 * 4 if ksplit > 1 else 0))
    rows = defines.get("GROUPS_XSMEM", 0)  # token rows a staged pass (0: none staged)
    dynamic = (4 * rows * (in_features // 128) + 1) * GROUPS_XSMEM_RECORD if rows else 0
    if static + dynamic > SHARED_BYTES_MOST:
        raise ValueError(f"moe_gemv_int4_groups {defines} over K = {in_features} needs {static + dynamic} bytes of "
                         f"shared memory, more than {SHARED_BYTES_MOST}; use another lane-groups GEMV")
    return static, dynamic


def _launch_groups(grid: tuple[int, int], args: tuple, defines: dict[str, int], in_features: int) -> None:
    """moe_int4.cu's moe_gemv_int4_groups over ``grid``, its dynamic shared memory sized (and allowed past 48 KB where
    the static and dynamic together need it)."""
    static, dynamic = groups_shared_bytes(defines, in_features)
    built = kernel("moe_int4.cu", "moe_gemv_int4_groups", **defines)
    if static + dynamic > SHARED_BYTES_DEFAULT and built.max_dynamic_shared_size_bytes < dynamic:
        built.max_dynamic_shared_size_bytes = dynamic
    built(grid, (MMA_GEMV_WARPS * 32,), args, shared_mem=dynamic)


def int4_row_blocks(column_blocks: int, tile_rows: int, min_blocks: int, value: str | None = None) -> int:
    """GROUPS_ROW_BLOCKS for a moe_gemv_int4_groups grid of ``column_blocks`` x ``tile_rows`` blocks of which an SM
    holds ``min_blocks`` (see INT4_ROW_BLOCKS_ENV); a bad value is a clear error."""
    value = (value if value is not None else os.environ.get(INT4_ROW_BLOCKS_ENV, "")).strip().lower() \
        or DEFAULT_INT4_ROW_BLOCKS
    if value == "auto":
        if tile_rows > ROW_BLOCKS_MAX_TILES or column_blocks < 2:
            return 1
        waves = column_blocks * tile_rows / (sm_count(cupy.cuda.Device().id) * min_blocks)
        return max(1, min(ROW_BLOCKS_MOST, column_blocks, round(waves))) if waves >= 1.25 else 1
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{INT4_ROW_BLOCKS_ENV} must be auto or a positive integer, got {value!r}")
    return min(int(value), column_blocks)
# The one place the decode GEMV is chosen, per weight format: by rows per weight (dense: the linear's
# rows; grouped: the step's slots averaged over the experts, T·k / E), the first entry whose bound
# holds; past the last, no GEMV (dense: dequantize + cuBLAS, or the per-tile GEMM without a handle;
# grouped: the per-tile GEMM). H100, benchmarks/gpu_kimi.py, 2026-11-23 windows W1/W2 (GPU.md):
#  * FP8 dense 7168x8192: wide2 29 / 60 us at 1 / 4 rows vs moe_gemv 39 / 71; at 8 rows dequantize +
#    cuBLAS 114 us vs moe_gemv 117, wide2 118, mma 125; 16 and 32 rows: dequantize 111 us, mma 129 / 260.
#  * INT4 experts (384 x top-8, Kimi-K2 layer, CUDA graph): moe_gemv_mma ahead of moe_gemv at 0.02 slots
#    per expert (gate_up + down 0.17 vs 0.25 ms), at 1.3 (3.9 vs 9.4 ms) and, against the per-tile GEMM,
#    at 5.3 (5.7 vs 19.9 ms); W1's down projection: 2.9x moe_gemv at 64 tokens, 5.2x at 256. W3a,
#    gate_up alone: mma 87 / 1018 / 2574 / 3654 / 4083 us at 0.02 / 0.3 / 1.3 / 5.3 / 10.7 slots per
#    expert vs moe_gemv 121 / 1725 / 5466 and the per-tile GEMM 12899 / 13207 at 5.3 / 10.7.
#  * bf16 experts (Moonlight, 64 x top-6), W3a: moe_gemv_wide (4 columns per warp) ahead at 0.1 and 1.5
#    slots per expert (gate_up 26 vs moe_gemv 31 us, 204 vs 247; down 16 vs 19, 121 vs 174), mma at 6
#    (gate_up 380 vs the per-tile GEMM 416 us, down 190 vs 236); the per-tile GEMM from 24 (467 vs 779).
#  * INT4 experts, H200 E3 (2026-11-24, one Kimi-K2 layer, results/kimi_layer_b1_e3_h200.json / _b64_):
#    moe_gemv_mma_staged (falls back to moe_gemv_mma where the scales are not group 32 or K not whole
#    stages) gate_up 92 -> 73 / 2328 -> 2134 / 3398 -> 3246 us, down 55 -> 44 / 1161 -> 1134 / 1688 ->
#    1682 us at batch 1 / 64 / 256 (split K, mma_split4: 79 / 44 at batch 1). OPENINFER_MOE_GEMV=mma: before.
#  * bf16 experts, H200 E2 (results/kimi_gemv_e2_h200.json, kimi_moe_block_e2_h200.json): wide_nc gate_up 20.3 -> 19.9 / 156.6 -> 150.4 us, down 13.4 -> 13.1 / 103.0 -> 91.5 us at 1 / 16 tokens (Moonlight shapes, 1.02-1.13x); Moonlight MoE block (+ shared side stream) 63.1 -> 61.7 / 129.2 -> 128.1 / 288.5 -> 272.3 us at 1 / 4 / 16 tokens.
#    OPENINFER_MOE_GEMV=wide: before.
# Unmeasured rows keep the earlier choice (moe_gemv up to GEMV_MAX_ROWS / GEMV_MAX_ROWS_PER_EXPERT).
GemvChoice = tuple[tuple[float, str], ...]
DENSE_GEMV_CHOICE: dict[str, GemvChoice] = {
    "bf16": ((GEMV_MAX_ROWS, "moe_gemv"),), "int4": ((GEMV_MAX_ROWS, "moe_gemv"),),
    "fp8": ((4, "wide2"), (7, "moe_gemv")),
}
GROUPED_GEMV_CHOICE: dict[str, GemvChoice] = {
    "bf16": ((1.5, "wide_nc"), (6, "mma")), "int4": ((11, "mma_staged"),),
    "fp8": ((GEMV_MAX_ROWS_PER_EXPERT, "moe_gemv"),),
}
# A kernel forced (argument or GEMV_KERNEL_ENV) runs up to its own bounds: (dense rows, slots per
# expert). The CUDA-core kernels spend an FMA per weight and row; moe_gemv_mma shares each weight
# fragment among a pass's 16 rows.
GEMV_ROW_LIMITS: dict[str, tuple[int, int]] = {
    "moe_gemv": (GEMV_MAX_ROWS, GEMV_MAX_ROWS_PER_EXPERT), "wide": (GEMV_MAX_ROWS, GEMV_MAX_ROWS_PER_EXPERT),
    "wide8_r1_nc": (GEMV_MAX_ROWS, GEMV_MAX_ROWS_PER_EXPERT), "wide4_r1_nc": (GEMV_MAX_ROWS, GEMV_MAX_ROWS_PER_EXPERT),
    "wide2": (GEMV_MAX_ROWS, GEMV_MAX_ROWS_PER_EXPERT), "wide_nc": (GEMV_MAX_ROWS, GEMV_MAX_ROWS_PER_EXPERT),
    **{name: (32, 32) for name in TENSOR_CORE_GEMVS + TILED_GEMVS + GROUPS_GEMVS}}
WIDE_WARPS = 4  # moe.cu
MMA_GEMV_WARPS, MMA_GEMV_COLUMNS = 4, 16  # moe.cu: warps per block, output columns per warp
# moe_pipelined.cu's grouped GEMM for bf16 experts: moe_grouped_gemm loads a tile, waits, multiplies (one
# 8 KB weight tile in flight per block); this one keeps PIPE_STAGES - 1 k-tiles of 128 (or 256) weight rows
# in flight (cp.async) and multiplies only the m16 slices a tile's rows use. OPENINFER_MOE_PIPELINED=tiles
# takes it wherever the per-tile moe_grouped_gemm ran and, above PIPELINED_ABOVE_ROWS_PER_EXPERT slots per
# expert, instead of the decode GEMV; =fused (the default since E1) also fuses gate_up with SiLU·mul; =off:
# before. H200 E1 (2026-11-24, results/kimi_experts_e1_h200.json; Moonlight's routed experts, one layer,
# gate_up + SiLU·mul + down, CUDA graph): fused vs what ran before 319 vs 443 us at 64 tokens (6 slots per
# expert, moe_gemv_mma), 338 vs 663 at 128, 401 vs 722 at 256 (24, per-tile GEMM: 36 -> 65 % of the copy
# bandwidth), 815 vs 1352 at 1024 (96; 256-row blocks); behind moe_gemv_wide at 1 / 4 / 16 tokens (60 vs
# 36, 123 vs 99, 270 vs 263 us) and cuBLAS per expert at 8192 (5018 vs 2892 us, eager).
PIPELINED_ENV = "OPENINFER_MOE_PIPELINED"
PIPELINED_MODES = ("off", "tiles", "fused")
PIPELINED_ABOVE_ROWS_PER_EXPERT = 1.5  # up to here: moe_gemv_wide (bf16 table), whatever the mode
PIPE_WARPS = 4  # moe_pipelined.cu
PIPE_STAGES = 4
# Block shapes (moe_pipelined.cu defines): 128 weight rows x 64-wide k-tiles (a warp: 4 n8 mma tiles),
# or 256 x 32 (8 n8 tiles: fewer shared-memory fragment reads per mma, for prefill-sized tiles); both
# 2 blocks per SM at 4 stages. Chosen by slots per expert (the first entry whose bound holds). H200 E1
# (fused, same runs as above): n128 ahead up to 24 slots per expert (401 vs 503 us at 24, 319 vs 466 at
# 6), n256 from 96 (815 vs 943 us at 96, 5018 vs 6232 at 768); the bound between is the midpoint.
# n64 (2 n8 tiles per warp: 3 blocks per SM, twice n128's blocks for a decode step) is unmeasured.
PIPE_SHAPES: dict[str, dict[str, int]] = {"n64": {"PIPE_WARP_N8": 2, "PIPE_TILE_K": 64},
                                          "n128": {"PIPE_WARP_N8": 4, "PIPE_TILE_K": 64},
                                          "n256": {"PIPE_WARP_N8": 8, "PIPE_TILE_K": 32}}
PIPE_SHAPE_CHOICE: tuple[tuple[float, str], ...] = ((48, "n128"), (float("inf"), "n256"))


def pipe_shape_for(slots_per_expert: float) -> str:
    """The moe_pipelined.cu block shape (PIPE_SHAPES) for a step's slots per expert."""
    return next(name for most, name in PIPE_SHAPE_CHOICE if slots_per_expert <= most)


DEFAULT_PIPELINED_MODE = "fused"
# Whether, in a pipelined mode, bf16 experts keep moe_grouped_gemm_pipelined even where cuBLAS per expert
# would run (big eager steps, BLAS_MIN_ROWS_PER_EXPERT): no host read of the counts per layer.
PIPELINED_BEFORE_BLAS = False


def pipelined_mode(mode: str | None = None) -> str:
    """``mode``, else $OPENINFER_MOE_PIPELINED (DEFAULT_PIPELINED_MODE when unset; "0"/"1" spell off/tiles)."""
    name = mode or os.environ.get(PIPELINED_ENV) or DEFAULT_PIPELINED_MODE
    name = {"0": "off", "false": "off", "1": "tiles", "true": "tiles"}.get(name, name)
    if name not in PIPELINED_MODES:
        raise ValueError(f"unknown {PIPELINED_ENV} mode {name!r}; one of {', '.join(PIPELINED_MODES)}")
    return name


def pipelined_ready(a: cupy.ndarray, weight: ExpertLinear, fuse_silu: bool = False) -> bool:
    """moe_grouped_gemm_pipelined's needs: bf16 weights, whole 16-byte pieces of K, 16-byte aligned
    rows of A and the weight, an even N (4-byte output stores); fused: N = 2I with I even."""
    return (weight.format == "bf16" and weight.in_features % 8 == 0 and a.data.ptr % 16 == 0
            and weight.data.data.ptr % 16 == 0 and weight.out_features % (4 if fuse_silu else 2) == 0)


def _launch_pipelined(weight: ExpertLinear, grid_rows: int, args: tuple, fuse_silu: bool, shape: str,
                      stages: int = PIPE_STAGES) -> None:
    """moe_grouped_gemm_pipelined (block shape ``shape``) over ``grid_rows`` 64-row tiles; ``args``
    its argument list."""
    defines = PIPE_SHAPES[shape]
    fn = kernel("moe_pipelined.cu", "moe_grouped_gemm_pipelined", PIPE_STAGES=stages, PIPE_FUSE_SILU=int(fuse_silu),
                **defines)
    tile_n = PIPE_WARPS * defines["PIPE_WARP_N8"] * 8
    shared = stages * (TILE_M + tile_n) * (defines["PIPE_TILE_K"] + 8) * 2
    if fn.max_dynamic_shared_size_bytes < shared:
        fn.max_dynamic_shared_size_bytes = shared
    columns = tile_n // 2 if fuse_silu else tile_n
    out_features = weight.out_features // 2 if fuse_silu else weight.out_features
    fn((grid_rows, -(-out_features // columns)), (PIPE_WARPS * 32,), args, shared_mem=shared)


# moe_routing.cu's moe_combine_vec8 (8 columns per thread, every slot's 16 bytes in flight; the same sums in the
# same order: the same bits) combines steps of at least COMBINE_VEC_MIN_TOKENS tokens where the rows allow it
# (OPENINFER_MOE_COMBINE_VEC=1 / =0: at any size / never). E1 (H200, 2026-11-24, Moonlight 64 x top-6 x 2048,
# results/moe_routing_e1_h200.json): 256 tokens 5.4 -> 3.4 us, 1024 15.5 -> 9.0 us (graphs), 4096 91.9 -> 65.9,
# 8192 162.5 -> 108.8 us (eager); at 16 / 64 tokens moe_combine is ahead (2.5 vs 2.9, 2.8 vs 3.0 us). Opt-in
# for s8's last hours (E2's Moonlight fault), cleared by s9 D1's bisect (the fault was the decode routing).
COMBINE_VEC_ENV, COMBINE_VEC_THREADS, COMBINE_VEC_MIN_TOKENS = "OPENINFER_MOE_COMBINE_VEC", 256, 256


@dataclass
class ExpertLinear:
    """One projection of all experts of a layer (or one dense linear when ``num_experts == 1``)."""

    format: str
    data: cupy.ndarray
    scale: cupy.ndarray | None
    out_features: int
    in_features: int
    group: int = 32  # INT4 group size
    block: int = 128  # FP8 block size
    layout: str = "rows"  # INT4: "rows" (checkpoint [E, N, K/8]), "tiled" or "lane_groups" (tile_int4)

    @property
    def num_experts(self) -> int:
        return int(self.data.shape[0])

    def expert(self, e: int) -> ExpertLinear:
        return ExpertLinear(self.format, self.data[e:e + 1], None if self.scale is None else self.scale[e:e + 1],
                            self.out_features, self.in_features, self.group, self.block, self.layout)

    def _kernel(self, name: str = "moe_grouped_gemm", **defines: int) -> cupy.RawKernel:
        tiled = {"INT4_TILED": INT4_TILED_DEFINE[self.layout]} if self.layout in INT4_TILED_DEFINE else {}
        return kernel("moe.cu", name, WEIGHT_FORMAT=FORMATS[self.format], GROUP=self.group, FP8_BLOCK=self.block,
                      **tiled, **defines)

    def gemv_ready(self, a: cupy.ndarray) -> bool:
        """moe_gemv's needs: whole 16-byte weight chunks per row (K a multiple of the chunk, one FP8
        scale per chunk) and 16-byte aligned rows of ``a`` and of the weight."""
        chunk = WEIGHT_CHUNK[self.format]
        return (self.in_features % chunk == 0 and (self.format != "fp8" or self.block % chunk == 0)
                and a.data.ptr % 16 == 0 and self.data.data.ptr % 16 == 0)


INT4_LAYOUT_ENV = "OPENINFER_INT4_LAYOUT"
INT4_LAYOUTS = ("rows", "tiled", "lane_groups")
INT4_TILED_DEFINE = {"tiled": 1, "lane_groups": 2}  # moe.cu INT4_TILED of each repacked layout
# "tiled" by default since E1 of 2026-11-24 (H200, results/kimi_layer_s8e1.json, one Kimi-K2 layer, graph
# replay; the same random weights repacked, TILED_GEMV): 252.8 -> 232.0 / 3640.9 -> 2965.5 / 5976.0 -> 5602.0
# us at batch 1 / 64 / 256 (routed experts' gate_up 74.1 -> 59.5, down 44.4 -> 37.6 us at batch 1).
# OPENINFER_INT4_LAYOUT=rows: before (the checkpoint layout, moe_gemv_mma_staged).
# "lane_groups" by default since D2 of 2026-11-24 (H200, results/kimi_layer_int4d_d2_h200.json, one Kimi-K2
# layer, graph replay, the same random weights repacked; moe_int4.cu's GEMV by LANE_GROUPS_CHOICE): 226.7 -> 200.0
# / 2850.7 -> 2609.5 / 5223.9 -> 5368.6 us at batch 1 / 64 / 256 (51.0 -> 57.8 % of the HBM roofline at batch 1;
# routed experts' gate_up 59.0 -> 43.7, down 37.6 -> 26.6 us; batch 256, 5.3 slots per expert, runs moe_gemv_mma
# on this layout: 0.97x). OPENINFER_INT4_LAYOUT=tiled: before.
DEFAULT_INT4_LAYOUT = "lane_groups"


def int4_layout(layout: str | None = None) -> str:
    """``layout``, else $OPENINFER_INT4_LAYOUT, else DEFAULT_INT4_LAYOUT (checked against INT4_LAYOUTS)."""
    name = layout or os.environ.get(INT4_LAYOUT_ENV) or DEFAULT_INT4_LAYOUT
    if name not in INT4_LAYOUTS:
        raise ValueError(f"unknown INT4 layout {name!r} ({INT4_LAYOUT_ENV}); one of {', '.join(INT4_LAYOUTS)}")
    return name


def upload_expert_linear(format: str, data: np.ndarray, scale: np.ndarray | None, shape: tuple[int, int],
                         group: int = 32, block: int = 128, layout: str | None = None) -> ExpertLinear:
    """Host arrays (stacked over experts, as stored in the checkpoint) → device. ``bf16`` data is
    uint16 bf16 bits; ``int4`` int32 words + uint16 (bf16) scales; ``fp8`` uint8 codes + fp32 scales.
    ``layout`` (INT4; default ``int4_layout()``): "tiled" repacks INT4 weights that fit it
    (``int4_tiling_fits``) for the decode GEMV; others stay as stored."""
    if format not in FORMATS:
        raise ValueError(f"unknown expert weight format {format!r}; one of {sorted(FORMATS)}")
    out_features, in_features = shape
    if format == "int4" and (in_features % group or group % 8):
        raise ValueError(f"INT4 in_features {in_features} must be a multiple of the group size {group} (itself of 8)")
    weight = ExpertLinear(format, cupy.asarray(np.ascontiguousarray(data)),
                          None if scale is None else cupy.asarray(np.ascontiguousarray(scale)),
                          out_features, in_features, group, block)
    return tiled_int4(weight, int4_layout(layout)) if format == "int4" else weight


def tiled_int4(weight: ExpertLinear, layout: str = "tiled") -> ExpertLinear:
    """``weight`` (INT4, checkpoint layout) repacked on the device into ``layout`` ("tiled" or
    "lane_groups"; "rows": as is), where it fits (``int4_tiling_fits``); otherwise (or already repacked)
    ``weight`` itself. Takes a second copy while it runs."""
    if layout not in INT4_LAYOUTS:
        raise ValueError(f"unknown INT4 layout {layout!r}; one of {', '.join(INT4_LAYOUTS)}")
    if (layout == "rows" or weight.format != "int4" or weight.layout != "rows" or weight.scale is None
            or not int4_tiling_fits(weight.out_features, weight.in_features, weight.group)):
        return weight
    words, scales = tile_int4(weight.data, weight.scale, xp=cupy, lane_groups=layout == "lane_groups")
    return ExpertLinear("int4", words, scales, weight.out_features, weight.in_features, weight.group, weight.block,
                        layout)


def forced_gemv_kernel(gemv_kernel: str | None = None) -> str | None:
    """The decode GEMV kernel forced by ``gemv_kernel``, else by $OPENINFER_MOE_GEMV; None (or
    "auto"): chosen by rows (``choose_gemv``)."""
    name = gemv_kernel or os.environ.get(GEMV_KERNEL_ENV) or "auto"
    if name == "auto":
        return None
    if name not in GEMV_KERNELS:
        raise ValueError(f"unknown decode GEMV kernel {name!r} ({GEMV_KERNEL_ENV}); one of auto, "
                         f"{', '.join(sorted(GEMV_KERNELS))}")
    return name


def choose_gemv(rows_per_weight: float, grouped: bool, weight_format: str, gemv_kernel: str | None = None) -> str | None:
    """The decode GEMV kernel for ``rows_per_weight`` (dense rows, or slots per expert when
    ``grouped``) of a ``weight_format`` weight, or None when a GEMM should run instead: a forced
    kernel (``forced_gemv_kernel``) within its GEMV_ROW_LIMITS, else the first entry of the
    format's DENSE_ / GROUPED_GEMV_CHOICE that holds."""
    forced = forced_gemv_kernel(gemv_kernel)
    if forced is not None:
        return forced if rows_per_weight <= GEMV_ROW_LIMITS[forced][grouped] else None
    for most_rows, name in (GROUPED_GEMV_CHOICE if grouped else DENSE_GEMV_CHOICE)[weight_format]:
        if rows_per_weight <= most_rows:
            return name
    return None


def gemv_for(rows_per_weight: float, grouped: bool, weight_format: str, gemv_kernel: str | None = None) -> str:
    """The kernel when a decode GEMV is required whatever the rows (``gemv=True``): ``choose_gemv``'s,
    else the forced one, else the table's last (the one chosen for the most rows)."""
    table = (GROUPED_GEMV_CHOICE if grouped else DENSE_GEMV_CHOICE)[weight_format]
    return (choose_gemv(rows_per_weight, grouped, weight_format, gemv_kernel) or forced_gemv_kernel(gemv_kernel)
            or table[-1][1])


def layout_gemv(weight: ExpertLinear, name: str | None, gemv_kernel: str | None = None,
                rows_per_weight: float = 0.0, one_token: bool = False, fused: bool = False) -> str | None:
    """The decode GEMV for ``weight`` where the tables chose ``name``: TILED_GEMV for tiled INT4
    weights, LANE_GROUPS_ONE_TOKEN (``fused``, SiLU·mul in it: LANE_GROUPS_ONE_TOKEN_FUSED first) in a grouped
    step of ``one_token``, else LANE_GROUPS_CHOICE's by ``rows_per_weight`` for lane-groups ones (past it
    ``name``), unless a kernel is forced (``forced_gemv_kernel``); else ``name``."""
    if name is None or forced_gemv_kernel(gemv_kernel) is not None:
        return name
    if weight.layout == "tiled":
        return TILED_GEMV
    if weight.layout == "lane_groups":
        one = (fused and LANE_GROUPS_ONE_TOKEN_FUSED) or LANE_GROUPS_ONE_TOKEN
        if one_token and one is not None:
            return one
        return next((kernel for most, kernel in LANE_GROUPS_CHOICE if rows_per_weight <= most), name)
    return name


def _launch_gemv(weight: ExpertLinear, args: tuple, grid_rows: int, dense_rows: int, name: str) -> None:
    """GEMV kernel ``name`` (moe_gemv / moe_gemv_wide / moe_gemv_mma) over ``grid_rows`` tiles
    (grouped) or ``dense_rows`` rows (dense mode: ``grid_rows`` 0). ``args``: the kernels' shared
    argument list."""
    if name == "moe_gemv":
        rows_grid = grid_rows or -(-dense_rows // GEMV_ROWS)
        weight._kernel("moe_gemv")((-(-weight.out_features // GEMV_WARPS), rows_grid), (GEMV_WARPS * 32,), args)
        return
    defines = GEMV_KERNELS[name]
    if name in GROUPS_GEMVS:
        if weight.layout == "lane_groups":
            columns = MMA_GEMV_WARPS // defines.get("GROUPS_KSPLIT", 1) * MMA_GEMV_COLUMNS  # moe_int4.cu GROUPS_WARPS x 16
            column_blocks = -(-weight.out_features // columns)
            streamed = defines.get("GROUPS_ROW_STREAM", 0)  # its row blocks "auto" unless INT4_ROW_BLOCKS_ENV says
            row_blocks = int4_row_blocks(column_blocks, grid_rows or 1, defines.get("GROUPS_MIN_BLOCKS", 4),
                                         "auto" if streamed and not os.environ.get(INT4_ROW_BLOCKS_ENV) else None)
            if row_blocks > 1:
                defines = {**defines, "GROUPS_ROW_BLOCKS": row_blocks}
            elif streamed:  # one column block a block: the unstreamed kernel
                defines = {k: v for k, v in defines.items() if k != "GROUPS_ROW_STREAM"}
            _launch_groups((-(-column_blocks // row_blocks), grid_rows or 1), args, defines, weight.in_features)
            return
        defines = {"MMA_GEMV_NTILES": 2}  # other layouts: moe_gemv_mma
        name = "mma"
    if "TILED_NTILES" in defines:
        if weight.layout == "tiled":
            rows_per_warp = 2 if defines.get("TILED_PAIR") else defines.get("TILED_ROW_BLOCKS", 1)
            columns = MMA_GEMV_WARPS * MMA_GEMV_COLUMNS * rows_per_warp  # moe.cu TILED_WARPS x 16 x ...
            weight._kernel("moe_gemv_int4_tiled_pair" if defines.get("TILED_PAIR") else "moe_gemv_int4_tiled", **defines)((-(-weight.out_features // columns), grid_rows or 1),
                                                              (MMA_GEMV_WARPS * 32,), args)
            return
        defines = {"MMA_GEMV_NTILES": defines["TILED_NTILES"]}  # checkpoint layout: moe_gemv_mma
        name = "mma"
    if "STAGED_CHUNKS" in defines:
        if staged_ready(weight, defines["STAGED_CHUNKS"]):
            columns = MMA_GEMV_WARPS * MMA_GEMV_COLUMNS  # moe.cu STAGED_WARPS x 16
            weight._kernel("moe_gemv_mma_staged", **defines)((-(-weight.out_features // columns), grid_rows or 1),
                                                              (MMA_GEMV_WARPS * 32,), args)
            return
        defines = {"MMA_GEMV_NTILES": defines["MMA_GEMV_NTILES"]}  # elsewhere: moe_gemv_mma
    if name in TENSOR_CORE_GEMVS:  # dense mode: one block row loops over all rows
        columns = MMA_GEMV_WARPS // defines.get("MMA_GEMV_KSPLIT", 1) * MMA_GEMV_COLUMNS
        weight._kernel("moe_gemv_mma", **defines)((-(-weight.out_features // columns), grid_rows or 1),
                                                   (MMA_GEMV_WARPS * 32,), args)
        return
    columns = WIDE_WARPS * defines["WIDE_COLUMNS"]  # dense mode: one block row loops over all rows
    weight._kernel("moe_gemv_wide", **defines)((-(-weight.out_features // columns), grid_rows or 1),
                                                (WIDE_WARPS * 32,), args)


def staged_ready(weight: ExpertLinear, chunks: int) -> bool:
    """moe_gemv_mma_staged's needs: INT4 with group-32 scales, K whole stages of ``chunks`` x 128
    weights (so 16-byte aligned weight and scale rows)."""
    return (weight.format == "int4" and weight.group == 32 and weight.in_features % (chunks * 128) == 0
            and weight.layout == "rows")


def _vectorised(a: cupy.ndarray, weight: ExpertLinear) -> bool:
    """16-byte tile loads need K % 8 == 0 and 16-byte aligned rows of A and of the weight."""
    return (weight.in_features % 8 == 0 and a.data.ptr % 16 == 0 and weight.data.data.ptr % 16 == 0)


def blas_eligible(num_slots: int, weight: ExpertLinear, blas) -> bool:
    """Whether ``grouped_gemm`` with ``blas`` takes cuBLAS per expert (see BLAS_MIN_ROWS_PER_EXPERT)."""
    return (blas is not None and num_slots >= max(1, BLAS_MIN_ROWS_PER_EXPERT * weight.num_experts)
            and os.environ.get(BLAS_ENV, "1") not in ("0", "false", "off")
            and not cupy.cuda.get_current_stream().is_capturing())


def _grouped_by_blas(a: cupy.ndarray, weight: ExpertLinear, grouping: ExpertGroupingDevice, gather: bool, blas,
                     out: cupy.ndarray) -> None:
    """cuBLAS on each active expert's rows (gathered into expert order first when ``gather``);
    quantized experts are dequantised to a bf16 scratch one at a time."""
    offsets = cupy.asnumpy(grouping.offsets)  # the host sync: rows per expert
    rows = a[grouping.sorted_slots // grouping.top_k] if gather else a
    for e in np.flatnonzero(np.diff(offsets)):
        begin, end = int(offsets[e]), int(offsets[e + 1])
        expert_weight = weight.data[e] if weight.format == "bf16" else dequantize(weight.expert(int(e)))
        blas.matmul_nt(rows[begin:end], expert_weight, out[begin:end])


def grouped_gemm(a: cupy.ndarray, weight: ExpertLinear, grouping: ExpertGroupingDevice, gather: bool,
                 gemv: bool | None = None, *, gemv_kernel: str | None = None, blas=None,
                 pipelined: str | None = None, pipe_shape: str | None = None, sm90: bool | None = None,
                 overlap_previous: bool = False) -> cupy.ndarray:
    """Rows in expert order: ``out[p] = A[row(p)] · W_e(p)^T`` with ``row(p)`` the token of slot p
    (``gather``) or p itself. ``out`` is ``[T·k, N]`` bf16. ``gemv``: force (True) or forbid
    (False) the decode GEMV; None lets ``choose_gemv`` decide by the slots per expert.
    ``gemv_kernel``: force one (see ``GEMV_KERNELS``; default: $OPENINFER_MOE_GEMV, else the table).
    ``blas`` (a cuBLAS handle): big eager steps take cuBLAS per expert (``blas_eligible``).
    ``pipelined`` (default $OPENINFER_MOE_PIPELINED): "tiles"/"fused" runs bf16 experts' GEMM
    through moe_grouped_gemm_pipelined wherever the per-tile GEMM would run, and instead of the
    chosen decode GEMV above PIPELINED_ABOVE_ROWS_PER_EXPERT slots per expert (unless one is forced);
    ``pipe_shape`` forces its block shape (PIPE_SHAPES; default ``pipe_shape_for``).
    ``sm90``: force (True; the caller checks ``sm90_ready``) or forbid the Hopper kernel (moe_sm90.py);
    None takes it where ``sm90_experts`` says (OPENINFER_MOE_SM90, bf16 experts above
    SM90_ABOVE_ROWS_PER_EXPERT slots per expert) unless the caller picked a path (``gemv``,
    ``gemv_kernel``, ``pipelined``) or a GEMV is forced; ``overlap_previous``: see ``grouped_gemm_sm90``."""
    num_slots = int(grouping.sorted_slots.size)
    a = cupy.ascontiguousarray(a)
    if sm90 is None:
        sm90 = (gemv is None and gemv_kernel is None and pipelined is None and forced_gemv_kernel() is None
                and sm90_experts(a, weight, num_slots))
    if sm90:
        return grouped_gemm_sm90(a, weight, grouping, gather, overlap_previous=overlap_previous)
    out = cupy.empty((num_slots, weight.out_features), dtype=cupy.uint16)
    if num_slots == 0:
        return out
    pipelined_first = PIPELINED_BEFORE_BLAS and pipelined_mode(pipelined) != "off" and pipelined_ready(a, weight)
    if (not gemv and not pipelined_first and blas_eligible(num_slots, weight, blas)
            and (weight.format == "bf16" or weight.gemv_ready(a))):
        _grouped_by_blas(a, weight, grouping, gather, blas, out)
        return out
    per_expert = num_slots / weight.num_experts
    name = choose_gemv(per_expert, True, weight.format, gemv_kernel) if gemv is None else \
        gemv_for(per_expert, True, weight.format, gemv_kernel) if gemv else None
    name = layout_gemv(weight, name, gemv_kernel, per_expert, one_token=num_slots == grouping.top_k)
    use_pipelined = (gemv is not True and pipelined_mode(pipelined) != "off" and pipelined_ready(a, weight)
                     and (name is None or (gemv is None and gemv_kernel is None and forced_gemv_kernel() is None
                                           and per_expert > PIPELINED_ABOVE_ROWS_PER_EXPERT)))
    tables = (grouping.tile_expert, grouping.tile_row, grouping.num_tiles, grouping.offsets, np.int32(0), out,
              np.int32(weight.out_features), np.int32(weight.in_features))
    head = (a, grouping.sorted_slots if gather else NULL, np.int32(grouping.top_k), weight.data,
            NULL if weight.scale is None else weight.scale)
    if use_pipelined:
        _launch_pipelined(weight, grouping.max_tiles, head[:4] + tables, False, pipe_shape or pipe_shape_for(per_expert))
        return out
    if name is not None and weight.gemv_ready(a):
        _launch_gemv(weight, head + tables, grouping.max_tiles, 0, name)
        return out
    grid = (grouping.max_tiles, -(-weight.out_features // TILE_N))
    weight._kernel()(grid, (GEMM_THREADS,), head + tables + (np.int32(_vectorised(a, weight)),))
    return out


def quantized_linear(x: cupy.ndarray, weight: ExpertLinear, blas=None, method: str | None = None, *,
                     gemv_kernel: str | None = None) -> cupy.ndarray:
    """``x [M, K] @ W^T`` for one (E = 1) quantized weight: W8A16 / W4A16. ``method`` (None: by
    M, see the module docstring): ``gemv`` (the decode GEMV, ``gemv_kernel`` picks which),
    ``tiles`` (moe_grouped_gemm dense mode, dequantised per tile) or ``dequantize`` (the whole
    weight to a bf16 scratch, then ``blas``)."""
    if x.ndim != 2 or x.shape[1] != weight.in_features:
        raise ValueError(f"quantized linear expects [tokens, {weight.in_features}], got {tuple(x.shape)}")
    rows = int(x.shape[0])
    out = cupy.empty((rows, weight.out_features), dtype=cupy.uint16)
    if rows == 0:
        return out
    x = cupy.ascontiguousarray(x)
    name = choose_gemv(rows, False, weight.format, gemv_kernel) if method is None else \
        gemv_for(rows, False, weight.format, gemv_kernel) if method == "gemv" else None
    name = layout_gemv(weight, name, gemv_kernel, rows)
    if method is None:
        method = "gemv" if name is not None else "dequantize" if blas is not None else "tiles"
    dense = (NULL, NULL, NULL, NULL, np.int32(rows), out, np.int32(weight.out_features),
             np.int32(weight.in_features))
    head = (x, NULL, np.int32(1), weight.data, NULL if weight.scale is None else weight.scale)
    if method == "gemv" and weight.gemv_ready(x):
        _launch_gemv(weight, head + dense, 0, rows, name)
    elif method == "dequantize" and blas is not None and weight.gemv_ready(x):
        blas.matmul_nt(x, dequantize(weight), out)
    else:
        grid = (-(-rows // TILE_M), -(-weight.out_features // TILE_N))
        weight._kernel()(grid, (GEMM_THREADS,), head + dense + (np.int32(_vectorised(x, weight)),))
    return out


def dequantize(weight: ExpertLinear) -> cupy.ndarray:
    """Expert 0 of ``weight`` as bf16 ``[N, K]`` (a fresh buffer from CuPy's pool: the scratch
    lives as long as the caller holds it)."""
    out = cupy.empty((weight.out_features, weight.in_features), dtype=cupy.uint16)
    chunks = weight.out_features * (weight.in_features // WEIGHT_CHUNK[weight.format])
    weight._kernel("moe_dequantize")((min(-(-chunks // 256), 65535),), (256,), (
        weight.data, NULL if weight.scale is None else weight.scale, np.int32(weight.out_features),
        np.int32(weight.in_features), out))
    return out


def combine_vec_wanted(num_tokens: int) -> bool:
    """$OPENINFER_MOE_COMBINE_VEC=1 / =0, unset: from COMBINE_VEC_MIN_TOKENS tokens (another value: a clear error)."""
    value = os.environ.get(COMBINE_VEC_ENV, "")
    return num_tokens >= COMBINE_VEC_MIN_TOKENS if value == "" else _switch(COMBINE_VEC_ENV)


def combine_vec_ready(y: cupy.ndarray, shared: cupy.ndarray | None, hidden: int, top_k: int) -> bool:
    """moe_combine_vec8's needs: whole 16-byte pieces of the rows, 16-byte aligned y and shared, k <= 16."""
    return (hidden % 8 == 0 and y.data.ptr % 16 == 0 and (shared is None or shared.data.ptr % 16 == 0)
            and top_k <= MAX_TOPK and y.flags.c_contiguous and (shared is None or shared.flags.c_contiguous))


# OPENINFER_MOE_COMBINE_PDL (opt-in, measured within noise: see moe_sm90.GATE_UP_PDL_ENV; =1 on): after the Hopper
# down projection (whose build lets the
# next kernel launch at its start), moe_combine is launched with programmatic stream serialization and waits for it in
# griddepcontrol.wait (moe.cu COMBINE_PDL): its launch and block start overlap the down projection's last wave. The
# same bits.
COMBINE_PDL_ENV = "OPENINFER_MOE_COMBINE_PDL"
DEFAULT_COMBINE_PDL = False


def combine_pdl_wanted() -> bool:
    """$OPENINFER_MOE_COMBINE_PDL (1 / 0; unset: DEFAULT_COMBINE_PDL; another value: a clear error)."""
    return _switch(COMBINE_PDL_ENV, default=DEFAULT_COMBINE_PDL)


def combine(y: cupy.ndarray, grouping: ExpertGroupingDevice, shared: cupy.ndarray | None, hidden: int,
            vectorized: bool | None = None, after_down: bool = False) -> cupy.ndarray:
    """``out[t] = Σ_j weights[t, j] · y[slot_pos[t·k + j]] (+ shared[t])``, bf16 ``[T, hidden]``:
    moe_combine, or with ``vectorized`` (default ``combine_vec_wanted``) moe_combine_vec8 (the same bits).
    ``after_down``: the previous kernel on the stream is the Hopper down projection that wrote ``y`` (then
    $OPENINFER_MOE_COMBINE_PDL launches moe_combine to overlap it)."""
    num_tokens = int(grouping.ids.shape[0])
    out = cupy.empty((num_tokens, hidden), dtype=cupy.uint16)
    if vectorized is None:
        vectorized = combine_vec_wanted(num_tokens)
    if num_tokens and vectorized and combine_vec_ready(y, shared, hidden, grouping.top_k):
        column_blocks = -(-hidden // (8 * COMBINE_VEC_THREADS))
        kernel("moe_routing.cu", "moe_combine_vec8")((num_tokens, column_blocks), (COMBINE_VEC_THREADS,), (
            y, grouping.slot_pos, grouping.weights, NULL if shared is None else shared, np.int32(grouping.top_k),
            np.int32(hidden), out))
        return out
    if num_tokens:
        # one column per thread (a lone block walks a 7168-wide row in 28 dependent rounds of 8
        # slot loads: 42 us at batch 1 on an H200)
        column_blocks = -(-hidden // 256) if fast_routing() else 1
        args = (y, grouping.slot_pos, grouping.weights, NULL if shared is None else shared, np.int32(grouping.top_k),
                np.int32(hidden), out)
        if after_down and combine_pdl_wanted() and sm90_pdl():
            launch(kernel("moe.cu", "moe_combine", COMBINE_PDL=1), (num_tokens, column_blocks), (256,), args,
                   after_previous=True)
        else:
            kernel("moe.cu", "moe_combine")((num_tokens, column_blocks), (256,), args)
    return out



# OPENINFER_MOE_COMBINE_NORM (opt-in until measured; =1 on): where a MoE layer's output goes straight into the next
# layer's add_rms_norm (the kimi model's layers but the last), moe_forward ends in rms_norm.cu's
# moe_combine_add_rms_norm instead of moe_combine + add_rms_norm: one launch a layer fewer (decode: each a few us
# of a latency-bound chain). The same bits (the block add_rms_norm's sums; the backend takes the row-per-warp
# add_rms_norm_rows from 256 rows, so only steps of at most COMBINE_NORM_MAX_TOKENS tokens fuse). Not faster in CUDA
# graphs, so off: Moonlight decode ledger (H200, s11 D2) b1 / b16 / b64 2.757 / 8.035 / 9.857 ms off vs 2.809 / 8.079 /
# 9.891 with this and OPENINFER_MLA_GATHER_Q (a graph's launches are cheap; a block per token does the combine's
# loads serially where moe_combine spreads them over more blocks).
# s13 (H200, gpu_step_timeline.py, one process, two rounds): Moonlight b16 / b64 0.995 / 0.992x, still off; a rewrite
# holding each thread's columns in registers (same bits) measured the same (0.996 / 0.994x; the kernel alone 4.52 vs
# 4.73 us apart at 16 tokens, benchmarks/gpu_moe_grouped.py norms) and was not kept.
COMBINE_NORM_ENV = "OPENINFER_MOE_COMBINE_NORM"
COMBINE_NORM_MAX_TOKENS = 128
DEFAULT_COMBINE_NORM = False


def combine_norm_wanted(num_tokens: int) -> bool:
    """$OPENINFER_MOE_COMBINE_NORM (1 / 0, unset: DEFAULT_COMBINE_NORM; another value: a clear error) and
    1..COMBINE_NORM_MAX_TOKENS tokens."""
    return _switch(COMBINE_NORM_ENV, default=DEFAULT_COMBINE_NORM) and 0 < num_tokens <= COMBINE_NORM_MAX_TOKENS


def combine_add_rms_norm(y: cupy.ndarray, grouping: ExpertGroupingDevice, shared: cupy.ndarray | None,
                         residual: cupy.ndarray, weight: cupy.ndarray, eps: float) -> tuple[cupy.ndarray, cupy.ndarray]:
    """``add_rms_norm(combine(y, grouping, shared), residual, weight, eps)`` in one launch (moe_combine_add_rms_norm):
    ``(out, residual_out)``, bf16 ``[T, hidden]`` each, the unfused pair's bits."""
    num_tokens, hidden = int(residual.shape[0]), int(residual.shape[1])
    if residual.dtype != cupy.uint16 or weight.dtype != cupy.uint16 or weight.shape != (hidden,):
        raise ValueError(f"combine_add_rms_norm wants a bf16 residual [T, H] and norm weight [H]; got residual "
                         f"{residual.dtype} {tuple(residual.shape)}, weight {weight.dtype} {tuple(weight.shape)}")
    if int(grouping.ids.shape[0]) != num_tokens or grouping.top_k > MAX_TOPK:
        raise ValueError(f"combine_add_rms_norm: {int(grouping.ids.shape[0])} routed tokens of {grouping.top_k} slots "
                         f"(at most {MAX_TOPK}), residual of {num_tokens}")
    residual = cupy.ascontiguousarray(residual)
    out, residual_out = cupy.empty_like(residual), cupy.empty_like(residual)
    if num_tokens:
        threads = min(1024, max(32, -(-hidden // 64) * 32))  # the block add_rms_norm's (its sum order)
        kernel("rms_norm.cu", "moe_combine_add_rms_norm")((num_tokens,), (threads,), (
            y, grouping.slot_pos, grouping.weights, NULL if shared is None else shared, np.int32(grouping.top_k),
            residual, weight, out, residual_out, np.int32(hidden), np.float32(eps)))
    return out, residual_out

@dataclass
class DeviceMoE:
    """One MoE layer on the device."""

    router: RouterSpec
    gate: cupy.ndarray  # [E, H] bf16
    correction_bias: cupy.ndarray | None  # [E] fp32
    gate_up: ExpertLinear  # [E, 2I, H]
    down: ExpertLinear  # [E, H, I]
    tid2eid: cupy.ndarray | None = None  # [vocab, k] int64
    # shared-experts fusion (``fuse_shared_experts``): the last ``shared_experts`` entries of the gate_up /
    # down stacks are the layer's shared experts, routed every token with weight 1 (0: none stacked)
    shared_experts: int = 0
    # moe_route_decode's counter kept with the layer (ROUTE_TICKET_ENV, default): zeroed here, and zero between calls
    # (the kernel's last block puts it back), so no zeroing node per call. One layer's routing runs once at a time.
    route_counter: cupy.ndarray = dataclasses.field(default_factory=lambda: cupy.zeros(1, cupy.uint32), repr=False,
                                                    compare=False)


# OPENINFER_MOE_ROUTE_TICKET: "layer" (the default since s16 D3) gives moe_route_decode the layer's own counter
# (DeviceMoE.route_counter) instead of a fresh one zeroed per call by a one-thread kernel node ("call"): that node sat
# on the critical path between o_proj and the router (s15 D7, Kimi-K2 layer b1: 0.9 us plus a launch gap). s16 D3
# (H200, Kimi-K2 layer b1 graph, alternated A B B A A B B A; results/kimi_layer_b1_s16d3_h200.json): 166.9 / 167.4 /
# 167.0 / 167.4 us vs 168.9 / 168.3 / 168.1 / 168.7 with "call" (s13 D3b: Moonlight's step 1.009x). The state this
# keeps across calls is one zero word a layer, which every call leaves zero. (Zeroing the per-call counter instead on a
# side stream forked before the attention, s16 D2: layer b1 190.8 / 191.8 / 192.1 / 190.8 us vs 169.0 / 168.7 / 168.8 /
# 169.4 without (results/kimi_layer_b1_s16d2_h200.json); deleted.)
ROUTE_TICKET_ENV = "OPENINFER_MOE_ROUTE_TICKET"
ROUTE_TICKETS = ("call", "layer")
DEFAULT_ROUTE_TICKET = "layer"


def route_ticket(layer: DeviceMoE) -> cupy.ndarray:
    """moe_route_decode's zeroed counter for a call on ``layer``: per ROUTE_TICKET_ENV (call / layer; unset: the
    default; another value: a clear error) the layer's own, or a fresh one zeroed here."""
    mode = os.environ.get(ROUTE_TICKET_ENV) or DEFAULT_ROUTE_TICKET
    if mode not in ROUTE_TICKETS:
        raise ValueError(f"{ROUTE_TICKET_ENV} is one of {', '.join(ROUTE_TICKETS)}; got {mode!r}")
    return layer.route_counter if mode == "layer" else route_decode_ticket()


# Shared-experts fusion (OPENINFER_MOE_SHARED_FUSED, read when a model prepares its weights): a shared SwiGLU
# MLP of S·I intermediate rows (S = shared intermediate / routed I) is S experts
# of I rows (its gate / up rows and down columns cut in S runs: the sum over the intermediate splits), stacked
# after the routed experts; moe_route gives every token those S experts with weight 1 (ROUTE_SHARED_EXPERTS),
# so their weights stream inside the routed experts' grouped GEMM / GEMV, and the two shared linears, their
# SiLU·mul and the side stream disappear. Numbers: the shared part is summed in fp32 with the routed ones
# (the unfused combine adds the shared MLP's bf16 output to the bf16-rounded routed sum), so results differ
# by bf16 roundings. bf16 experts only (the stack's format), every routed expert held (no expert parallel).
# On by default since D2 of 2026-11-24 (H200, benchmarks/results/moe_block_moe13c_d2.json, Moonlight's MoE block
# 64 x top-6 + 2 shared, graphs; =0 reverts): 58.7 -> 57.6 / 258.1 -> 254.4 / 321.8 -> 306.2 us at 1 / 16 / 64
# tokens (1.02 / 1.015 / 1.05x; with SM90_PDL 1.027 / 1.066x at 16 / 64), the unfused shared MLP's cuBLAS
# GEMMs at these rows running at 33-65 % of the copy bandwidth.
SHARED_FUSED_ENV = "OPENINFER_MOE_SHARED_FUSED"
DEFAULT_SHARED_FUSED = True


def shared_fusion_wanted() -> bool:
    """$OPENINFER_MOE_SHARED_FUSED (1 / 0; unset: DEFAULT_SHARED_FUSED; another value: a clear error)."""
    return _switch(SHARED_FUSED_ENV, default=DEFAULT_SHARED_FUSED)


def shared_fusion_fits(layer: DeviceMoE, shared_gate_up: cupy.ndarray, shared_down: cupy.ndarray) -> bool:
    """Whether ``fuse_shared_experts`` can stack these shared weights (bf16 ``[2·S·I, H]`` and ``[H, S·I]``)
    onto ``layer``'s bf16 experts (I their intermediate size, H hidden; S ≥ 1, within MAX_TOPK / MAX_EXPERTS)."""
    gate_up, down = layer.gate_up, layer.down
    if layer.shared_experts or gate_up.format != "bf16" or down.format != "bf16":
        return False
    inter, hidden = gate_up.out_features // 2, gate_up.in_features
    if (shared_gate_up.ndim != 2 or shared_down.ndim != 2 or shared_gate_up.dtype != cupy.uint16
            or shared_down.dtype != cupy.uint16 or not inter or gate_up.out_features % 2):
        return False
    rows, count = shared_gate_up.shape[0], shared_gate_up.shape[0] // (2 * inter)
    return (count >= 1 and rows == 2 * count * inter and shared_gate_up.shape[1] == hidden
            and shared_down.shape == (hidden, count * inter) and down.out_features == hidden
            and down.in_features == inter and layer.router.top_k + count <= MAX_TOPK
            and gate_up.num_experts + count <= MAX_EXPERTS)


def fuse_shared_experts(layer: DeviceMoE, shared_gate_up: cupy.ndarray, shared_down: cupy.ndarray) -> DeviceMoE:
    """``layer`` with its shared SwiGLU MLP (bf16 ``gate_up [2·S·I, H]`` = [gate; up] rows, ``down [H, S·I]``)
    stacked as S more experts after the routed ones (see SHARED_FUSED_ENV); new stacks, so the caller drops
    its references to the old ones (and to the shared weights) to free them. ``shared_fusion_fits`` first."""
    if not shared_fusion_fits(layer, shared_gate_up, shared_down):
        raise ValueError(f"cannot fuse shared experts gate_up {tuple(shared_gate_up.shape)} / down "
                         f"{tuple(shared_down.shape)} into bf16 experts of gate_up {tuple(layer.gate_up.data.shape)} "
                         f"({layer.gate_up.format}): want bf16 [2·S·I, H] and [H, S·I]")
    experts, inter, hidden = layer.gate_up.num_experts, layer.gate_up.out_features // 2, layer.gate_up.in_features
    count = shared_gate_up.shape[0] // (2 * inter)
    gate_up = cupy.empty((experts + count, 2 * inter, hidden), dtype=cupy.uint16)
    gate_up[:experts] = layer.gate_up.data
    gate_up[experts:, :inter] = shared_gate_up[:count * inter].reshape(count, inter, hidden)
    gate_up[experts:, inter:] = shared_gate_up[count * inter:].reshape(count, inter, hidden)
    down = cupy.empty((experts + count, hidden, inter), dtype=cupy.uint16)
    down[:experts] = layer.down.data
    down[experts:] = shared_down.reshape(hidden, count, inter).transpose(1, 0, 2)
    return dataclasses.replace(layer, gate_up=ExpertLinear("bf16", gate_up, None, 2 * inter, hidden),
                               down=ExpertLinear("bf16", down, None, hidden, inter), shared_experts=count)



# OPENINFER_MOE_L2_PREFETCH (opt-in until measured): at the start of a MoE layer (``start_l2_prefetch``, called
# before its attention) a side stream pulls the layer's fused shared experts' weights (every token's, so
# known before routing; Moonlight: 2 x 17.3 MB) into L2 (moe_routing.cu moe_l2_prefetch) while the attention
# block runs (latency-bound: HBM mostly idle there), so the expert GEMM later reads them from L2 instead of
# HBM. The experts' GEMM is a weight stream near the copy bandwidth (moe_sm90.py: 92 %), so every byte taken
# off it is time. "last" marks the lines evict-last: the GEMM reads the shared experts after the routed
# ones (expert order), whose stream would otherwise flush them; "normal" for the A/B. At most
# $OPENINFER_MOE_L2_PREFETCH_MB (default L2_PREFETCH_DEFAULT_MB; an H200 has 50 MB of L2) bytes, gate_up
# first (read first). A hint: the numbers never change; the side stream joins after the layer's MoE. The sm90 GEMM
# then takes the shared experts' units first (moe_sm90.rotated_units). Measured slower, so off: Moonlight decode
# ledger (H200, graphs; .wt RESULTS D1 / D2 of 2026-11-24 s11) b1 / b16 / b64 2.758 / 8.089 / 9.916 ms off vs
# 2.919 / 8.894 / 10.820 with =last (its L2 set-aside slowed every op, norms and attention too), and 2.757 / 8.035 /
# 9.857 off vs 2.843 / 8.226 / 9.967 with =normal at 22 MB (the gate_up rows only) and the rotated GEMM.
L2_PREFETCH_ENV, L2_PREFETCH_MB_ENV = "OPENINFER_MOE_L2_PREFETCH", "OPENINFER_MOE_L2_PREFETCH_MB"
L2_PREFETCH_MODES = ("off", "last", "normal")
L2_PREFETCH_DEFAULT_MODE, L2_PREFETCH_DEFAULT_MB = "off", 36
L2_PREFETCH_BLOCKS, L2_PREFETCH_THREADS = 16, 128  # moe_l2_prefetch: 16 KB chunks, ~2k of them per layer
_prefetch_streams: dict[int, tuple[cupy.cuda.Stream, cupy.cuda.Event, cupy.cuda.Event]] = {}
# evict-last lines live in L2's set-aside for persisting accesses (0 bytes unless asked for: then "last" is
# "normal"); "last" sets it aside once per device, at most the device's maximum (cudaDeviceSetLimit)
PERSISTING_L2_LIMIT, MAX_PERSISTING_L2_ATTRIBUTE = 0x06, 108  # cudaLimitPersistingL2CacheSize, cudaDevAttr...
_persisting_set: set[int] = set()


def _set_aside_persisting_l2(device: int, nbytes: int) -> None:
    """L2 set aside for evict-last lines: ``nbytes`` (at most the device's maximum), once per device; not while
    the current stream captures a graph (a device limit cannot change then: the first eager step sets it)."""
    if device in _persisting_set or cupy.cuda.get_current_stream().is_capturing():
        return
    _persisting_set.add(device)
    most = cupy.cuda.runtime.deviceGetAttribute(MAX_PERSISTING_L2_ATTRIBUTE, device)
    if most > 0:
        cupy.cuda.runtime.deviceSetLimit(PERSISTING_L2_LIMIT, min(int(most), nbytes))


def l2_prefetch_mode() -> str:
    """$OPENINFER_MOE_L2_PREFETCH: "off" / "0", "last" / "1", "normal" (unset: L2_PREFETCH_DEFAULT_MODE);
    another value is a clear error."""
    value = os.environ.get(L2_PREFETCH_ENV, "").lower() or L2_PREFETCH_DEFAULT_MODE
    value = {"0": "off", "false": "off", "1": "last", "true": "last", "on": "last"}.get(value, value)
    if value not in L2_PREFETCH_MODES:
        raise ValueError(f"{L2_PREFETCH_ENV} must be one of {', '.join(L2_PREFETCH_MODES)} (or 1 / 0), got {value!r}")
    return value


def l2_prefetch_bytes() -> int:
    """$OPENINFER_MOE_L2_PREFETCH_MB in bytes (unset: L2_PREFETCH_DEFAULT_MB; not a number >= 0: a clear error)."""
    value = os.environ.get(L2_PREFETCH_MB_ENV, "") or str(L2_PREFETCH_DEFAULT_MB)
    try:
        megabytes = float(value)
    except ValueError:
        megabytes = -1.0
    if not megabytes >= 0:
        raise ValueError(f"{L2_PREFETCH_MB_ENV} must be a number of megabytes >= 0, got {value!r}")
    return int(megabytes * 2**20)


def shared_expert_ranges(layer: DeviceMoE, most_bytes: int) -> list[cupy.ndarray]:
    """The fused shared experts' weights of ``layer`` as flat views, gate_up's then down's, together at most
    ``most_bytes`` (16-byte multiples); empty without fused shared experts."""
    if not layer.shared_experts:
        return []
    views, left = [], most_bytes
    for weight in (layer.gate_up, layer.down):
        if weight.format != "bf16" or not weight.data.flags.c_contiguous:
            continue
        flat = weight.data[weight.num_experts - layer.shared_experts:].reshape(-1)
        take = min(flat.nbytes, left) // 16 * 16
        if take:
            views.append(flat[:take // flat.itemsize])
            left -= take
    return views


def start_l2_prefetch(layer: DeviceMoE, mode: str | None = None) -> cupy.cuda.Event | None:
    """Launch ``moe_l2_prefetch`` of ``layer``'s shared experts on this device's prefetch stream (forked from
    the current stream) where ``mode`` (default ``l2_prefetch_mode``) is on; the event the current stream
    must wait for before the layer ends (``join_l2_prefetch``; inside a CUDA-graph capture the fork must
    join), else None."""
    mode = mode or l2_prefetch_mode()
    if mode == "off":
        return None
    views = shared_expert_ranges(layer, l2_prefetch_bytes())
    if not views:
        return None
    device = cupy.cuda.Device().id
    if mode == "last":
        _set_aside_persisting_l2(device, sum(v.nbytes for v in views))
    if device not in _prefetch_streams:
        _prefetch_streams[device] = (cupy.cuda.Stream(non_blocking=True), cupy.cuda.Event(disable_timing=True),
                                     cupy.cuda.Event(disable_timing=True))
    side, forked, joined = _prefetch_streams[device]
    forked.record(cupy.cuda.get_current_stream())
    side.wait_event(forked)
    first, second = views[0], views[1] if len(views) > 1 else None
    with side:
        kernel("moe_routing.cu", "moe_l2_prefetch")((L2_PREFETCH_BLOCKS,), (L2_PREFETCH_THREADS,), (
            first, np.int64(first.nbytes), NULL if second is None else second,
            np.int64(0 if second is None else second.nbytes), np.int32(mode == "last")))
        joined.record(side)
    return joined


def join_l2_prefetch(joined: cupy.cuda.Event | None) -> None:
    """The current stream waits for ``start_l2_prefetch``'s launch (None: nothing to wait for)."""
    if joined is not None:
        cupy.cuda.get_current_stream().wait_event(joined)

def pipelined_gate_up(x: cupy.ndarray, gate_up: ExpertLinear, grouping: ExpertGroupingDevice, blas) -> bool:
    """Whether ``moe_forward`` fuses gate_up and SwiGLU: OPENINFER_MOE_PIPELINED=fused, bf16 experts,
    no forced GEMV, more than PIPELINED_ABOVE_ROWS_PER_EXPERT slots per expert and no cuBLAS step."""
    num_slots = int(grouping.sorted_slots.size)
    return (pipelined_mode() == "fused" and forced_gemv_kernel() is None and pipelined_ready(x, gate_up, True)
            and num_slots > PIPELINED_ABOVE_ROWS_PER_EXPERT * gate_up.num_experts
            and (PIPELINED_BEFORE_BLAS or not blas_eligible(num_slots, gate_up, blas)))


def fused_gate_up_silu(a: cupy.ndarray, weight: ExpertLinear, grouping: ExpertGroupingDevice,
                       stages: int = PIPE_STAGES, shape: str | None = None) -> cupy.ndarray:
    """``silu_mul(grouped_gemm(a, weight, grouping, gather=True))`` in one moe_grouped_gemm_pipelined
    launch (bf16 ``weight`` = [gate; up], ``pipelined_ready(a, weight, fuse_silu=True)``): ``[T·k, I]``.
    ``shape``: the block shape (PIPE_SHAPES; default ``pipe_shape_for`` the slots per expert)."""
    num_slots = int(grouping.sorted_slots.size)
    out = cupy.empty((num_slots, weight.out_features // 2), dtype=cupy.uint16)
    if num_slots:
        a = cupy.ascontiguousarray(a)
        _launch_pipelined(weight, grouping.max_tiles, (
            a, grouping.sorted_slots, np.int32(grouping.top_k), weight.data, grouping.tile_expert, grouping.tile_row,
            grouping.num_tiles, grouping.offsets, np.int32(0), out, np.int32(weight.out_features),
            np.int32(weight.in_features)), True, shape or pipe_shape_for(num_slots / weight.num_experts), stages)
    return out


# Opt-in until measured: moe_forward runs the shared experts (``shared_experts``) on a side stream while the
# routed ones run (joined before the combine; inside CUDA-graph capture the two streams become parallel
# branches). A decode step's routing, grouping and small launches leave HBM idle between kernels; the
# shared experts' weight streams can fill those gaps. Same kernels, same numbers.
SHARED_OVERLAP_ENV = "OPENINFER_MOE_SHARED_OVERLAP"
# On by default (=1 forces it at any size, =0 off) for steps of at most this many tokens: E1 (H200,
# results/kimi_layer_e1_h200.json, kimi_moe_block_e1_h200.json; same bits) Kimi-K2 layer at batch 1
# 266.2 -> 249.9 us (1.07x), Moonlight MoE block (64 x top-6 + 2 shared, graph) 71.5 -> 62.8 / 140.0 ->
# 129.5 / 298.4 -> 289.5 us at 1 / 4 / 16 tokens (1.14 / 1.08 / 1.03x); Kimi-K2 batch 64 1.00x, 256 0.99x.
SHARED_OVERLAP_MAX_TOKENS = 16
_side_streams: dict[int, tuple[cupy.cuda.Stream, cupy.cuda.Event, cupy.cuda.Event]] = {}


def shared_overlap(tokens: int) -> bool:
    """Whether moe_forward overlaps the shared experts with the routed ones for a step of ``tokens``:
    $OPENINFER_MOE_SHARED_OVERLAP=1 / =0, unset: up to SHARED_OVERLAP_MAX_TOKENS; another value is a
    clear error."""
    value = os.environ.get(SHARED_OVERLAP_ENV, "").lower()
    if value not in ("", "0", "1", "false", "true", "off", "on"):
        raise ValueError(f"{SHARED_OVERLAP_ENV} must be 1 or 0 (on / off), got {value!r}")
    return tokens <= SHARED_OVERLAP_MAX_TOKENS if value == "" else value in ("1", "true", "on")


def _side_stream() -> tuple[cupy.cuda.Stream, cupy.cuda.Event, cupy.cuda.Event]:
    """This device's side stream and its fork / join events (made once: not while a graph is captured)."""
    device = cupy.cuda.Device().id
    if device not in _side_streams:
        _side_streams[device] = (cupy.cuda.Stream(non_blocking=True), cupy.cuda.Event(disable_timing=True),
                                 cupy.cuda.Event(disable_timing=True))
    return _side_streams[device]


# OPENINFER_MOE_SHARED_AFTER_ROUTE=1 (opt-in until measured): where the shared experts run on the side stream
# (shared_overlap), fork it after the routing's launches instead of before, so the router and the top-k do not
# wait for SMs the shared experts' GEMVs hold (Kimi-K2 layer at batch 1, D1 of s12: moe_router_logits 19.1 us and
# moe_route_sort 15.0 us beside the shared gate_up / down GEMVs, where alone the pair takes ~9 + ~13); the
# shared experts then share the bandwidth with the routed GEMVs. The same bits.
SHARED_AFTER_ROUTE_ENV = "OPENINFER_MOE_SHARED_AFTER_ROUTE"
DEFAULT_SHARED_AFTER_ROUTE = False


def shared_after_route(tokens: int) -> bool:
    """Whether moe_forward forks the shared experts after the routing (see SHARED_AFTER_ROUTE_ENV): the switch
    (1 / 0, unset: the default; another value: a clear error) where the step overlaps them at all."""
    return _switch(SHARED_AFTER_ROUTE_ENV, default=DEFAULT_SHARED_AFTER_ROUTE) and 0 < tokens and shared_overlap(tokens)


@dataclass(frozen=True)
class SharedExpertPhases:
    """A MoE layer's shared experts as ``moe_forward``'s two phases: ``up`` (``x [T, H]`` -> the gate_up output
    ``[T, 2I]``) and ``down`` (that -> ``[T, H]``: SiLU·mul, down projection). Called whole: ``down(up(x))``. Given
    in two phases, ``moe_forward`` may run ``down`` beside the routed experts' down projection instead of their
    gate_up (``shared_down_late``); a plain callable always runs whole."""

    up: Callable[[cupy.ndarray], cupy.ndarray]
    down: Callable[[cupy.ndarray], cupy.ndarray]

    def __call__(self, x: cupy.ndarray) -> cupy.ndarray:
        return self.down(self.up(x))


# OPENINFER_MOE_SHARED_DOWN_LATE=1 (opt-in until measured): where the shared experts run on the side stream
# (shared_overlap) and come as SharedExpertPhases, their down projection waits for the routed experts' gate_up
# (an event recorded after its launch) and runs beside the routed down projection instead. Why: at one token the
# routed INT4 gate_up reads 117 MB and already pulls ~2.9 TB/s alone, so the shared down (29 MB) beside it slows it
# (s15 D7 timeline, Kimi-K2 layer b1: 43.7 us beside the shared down vs 40.8 alone), while the routed down
# projection leaves bandwidth idle (62 MB at 2.7 TB/s: too few bytes in flight per SM). The same kernels and bits.
# Within noise in s16 D1 (H200, Kimi-K2 layer b1 graph, alternated; results/kimi_layer_b1_s16d1_h200.json): 169.7 /
# 169.2 us vs 169.3 / 168.1 (with the shared down at 4 columns a warp: 175.5 / 175.2); its timeline (_timeline_): the
# routed gate_up 43.7 -> 39.4 us, but the routed down 23.0 -> 25.9 beside the shared down's 23.8. s16 D3, with the
# layer's route counter: 168.2 / 167.9 / 168.5 / 168.2 vs 166.9 / 167.4 / 167.0 / 167.4 without. Kept opt-in.
SHARED_DOWN_LATE_ENV = "OPENINFER_MOE_SHARED_DOWN_LATE"
DEFAULT_SHARED_DOWN_LATE = False


def shared_down_late(tokens: int, shared_experts) -> bool:
    """Whether moe_forward runs ``shared_experts``' down phase beside the routed down projection (see
    SHARED_DOWN_LATE_ENV): the switch (1 / 0; unset: the default; another value: a clear error) where they come in
    phases (SharedExpertPhases) and the step overlaps them at all."""
    return (_switch(SHARED_DOWN_LATE_ENV, default=DEFAULT_SHARED_DOWN_LATE) and isinstance(
        shared_experts, SharedExpertPhases) and 0 < tokens and shared_overlap(tokens))


def _run_beside(run, forked: bool = False):
    """``run()`` on this device's side stream from this point of the current stream (``forked``: from the fork
    point ``fork_shared_experts`` recorded earlier), its one-row GEMVs narrowed (``gemv_beside_other_work``); its
    result and the event the combine must wait for."""
    side, fork, joined = _side_stream()
    if not forked:
        fork.record(cupy.cuda.get_current_stream())
    side.wait_event(fork)
    with side, gemv_beside_other_work():
        result = run()
        joined.record(side)
    return result, joined


def start_shared_experts(x: cupy.ndarray, shared_experts, forked: bool = False, up_only: bool = False
                         ) -> tuple[cupy.ndarray, cupy.cuda.Event | None]:
    """``shared_experts(x)`` (a callable) and the event the combine must wait for: run on the side
    stream when ``shared_overlap`` (event returned), else here (None). ``forked``: the side stream's fork
    event was recorded already (``fork_shared_experts``), earlier on this stream: the side stream starts
    from that point, not from here. ``up_only``: only the ``up`` phase of SharedExpertPhases, on the side
    stream (no event: ``finish_shared_experts`` runs the rest and returns it)."""
    if not x.shape[0] or not shared_overlap(int(x.shape[0])):
        return shared_experts(x), None
    if up_only:
        return _run_beside(lambda: shared_experts.up(x), forked)[0], None
    return _run_beside(lambda: shared_experts(x), forked)


def finish_shared_experts(hidden: cupy.ndarray, shared_experts: SharedExpertPhases) -> tuple[cupy.ndarray,
                                                                                          cupy.cuda.Event]:
    """The ``down`` phase of shared experts started with ``up_only``, on the side stream from this point of the
    current stream (after the routed gate_up's launch), and the event the combine must wait for."""
    return _run_beside(lambda: shared_experts.down(hidden))


# OPENINFER_MOE_ROUTE_BEFORE_SHARED=1 (opt-in until measured): where the shared experts run on the side stream
# (shared_overlap), moe_forward records the side stream's fork point before the routing but launches the routing
# first, then the shared experts from that fork point: the same graph edges (the shared experts still wait for
# nothing but the attention's output), but the router's node is made, and launched, before the shared GEMV's, so
# the router's CTAs take the SMs first instead of queueing behind a full wave of GEMV CTAs (s12 D3, Kimi-K2 layer
# at batch 1: moe_router_logits 18.9 us beside the shared gate_up GEMV, ~9 alone; moe_route_sort waited ~6 us for
# an SM). The same bits.
ROUTE_BEFORE_SHARED_ENV = "OPENINFER_MOE_ROUTE_BEFORE_SHARED"
DEFAULT_ROUTE_BEFORE_SHARED = False


def route_before_shared(tokens: int, one_launch: bool = False) -> bool:
    """Whether moe_forward launches the routing before the shared experts' side stream (see
    ROUTE_BEFORE_SHARED_ENV): the switch (1 / 0; another value: a clear error; unset: the default, or on where the
    routing is ``one_launch``, moe_route_decode, whose ~145-register blocks would wait for the GEMV's to leave room)
    where the step overlaps the shared experts at all."""
    return (_switch(ROUTE_BEFORE_SHARED_ENV, default=DEFAULT_ROUTE_BEFORE_SHARED or one_launch) and 0 < tokens
            and shared_overlap(tokens))


def fork_shared_experts() -> None:
    """Record the side stream's fork point here (``start_shared_experts(..., forked=True)`` starts from it)."""
    _side_stream()[1].record(cupy.cuda.get_current_stream())


def moe_forward(backend, x: cupy.ndarray, layer: DeviceMoE, shared: cupy.ndarray | None = None,
                token_ids: cupy.ndarray | None = None, shared_experts=None, add_norm: tuple | None = None):
    """Route → group → gate_up GEMM (gathering token rows) → SwiGLU → down GEMM → weighted combine
    (+ the shared experts' output: ``shared``, already computed, or ``shared_experts(x)``, a callable
    run here: ``start_shared_experts``). OPENINFER_MOE_PIPELINED=fused: the gate_up GEMM and SwiGLU
    as one launch where the step would run a GEMM (``pipelined_gate_up``); OPENINFER_MOE_SM90=1: in
    the Hopper kernel where it runs (``sm90_experts``). ``add_norm`` = (residual, norm weight, eps): returns
    ``add_rms_norm(out, residual, weight, eps)``'s pair instead, the combine fused into it where
    ``combine_norm_wanted``."""
    x = cupy.ascontiguousarray(x)
    if layer.shared_experts and (shared is not None or shared_experts is not None):
        raise ValueError("this MoE layer's shared experts are fused into its expert stacks (fuse_shared_experts): "
                         "pass neither shared nor shared_experts")
    # moe_route_decode's counter (route_ticket: the layer's, or zeroed before the side stream's fork point)
    decode = route_decode_wanted(x, layer, beside_shared=shared_experts is not None and shared_overlap(int(x.shape[0])))
    ticket = route_ticket(layer) if decode else None
    route_first = shared_experts is not None and shared_after_route(int(x.shape[0]))
    late_down = shared_experts is not None and shared_down_late(int(x.shape[0]), shared_experts)
    # ROUTE_BEFORE_SHARED_ENV: the fork point here, the shared experts launched after the routing
    forked = shared_experts is not None and not route_first and route_before_shared(int(x.shape[0]), decode)
    if forked:
        fork_shared_experts()
    elif not route_first:
        shared, joined = (start_shared_experts(x, shared_experts, up_only=late_down) if shared_experts is not None
                          else (shared, None))
    grouping = route_and_group(x, layer, ticket, one_launch=decode) if decode or route_sort_wanted(
        int(x.shape[0]), layer.router, layer.tid2eid, layer.shared_experts) else None
    if grouping is None:
        ids, weights = route(x, layer.gate, layer.router, layer.correction_bias, token_ids, layer.tid2eid,
                             layer.shared_experts)
        grouping = group_by_expert(ids, weights, layer.router.num_experts + layer.shared_experts)
    if route_first or forked:  # the side stream forks here (SHARED_AFTER_ROUTE_ENV) or from before the routing
        shared, joined = start_shared_experts(x, shared_experts, forked=forked, up_only=late_down)
    after_gate_up = None
    if late_down:  # SHARED_DOWN_LATE_ENV: the shared down projection beside the routed one
        hidden = shared

        def after_gate_up() -> None:
            nonlocal shared, joined
            shared, joined = finish_shared_experts(hidden, shared_experts)

    with rotated_units(layer.shared_experts if l2_prefetch_mode() != "off" else 0):
        y = routed_experts(backend, x, layer.gate_up, layer.down, grouping, after_gate_up)
    if joined is not None:  # the shared experts' side stream
        cupy.cuda.get_current_stream().wait_event(joined)
    if add_norm is None:
        return combine(y, grouping, shared, int(x.shape[1]),
                       after_down=joined is None and sm90_routed(x, layer.gate_up, grouping))
    residual, weight, eps = add_norm
    if combine_norm_wanted(int(x.shape[0])):
        return combine_add_rms_norm(y, grouping, shared, residual, weight, eps)
    return backend.add_rms_norm(combine(y, grouping, shared, int(x.shape[1])), residual, weight, eps)



# OPENINFER_MOE_GEMV_SILU (default on for moe_gemv_wide, =1 also the tiled INT4 GEMV, =0 off): where a decode
# step's gate_up runs moe_gemv_wide or (asked for) a tiled INT4 decode GEMV
# (register ring) or moe_gemv_wide (bf16 experts: Moonlight), that GEMV also applies SiLU·mul: the tiled one
# (moe.cu TILED_FUSE_SILU) walks each warp's 16 gate rows, then the matching 16 up rows; the wide one
# (WIDE_FUSE_SILU) gives each warp half gate, half up columns. One launch and one [slots, 2I] round trip fewer
# (Kimi-K2 layer at batch 1, E2: the silu_mul launch 3.1 us; Moonlight: one per layer). elementwise.cu's
# silu_mul formula on the bf16-rounded gate and up: the unfused pair's bits. E1 of 2026-11-24 (H200, one
# token): Moonlight's MoE block (results/kimi_moe_block_s8e1.json, with the one-launch routing) 55.6 -> 53.1 us;
# the tiled INT4 one was far slower (Kimi-K2 layer gate_up + silu 59.5 + 3.2 -> 142.0 us: its warps walk gate
# then up rows, as TILED_ROW_BLOCKS, which E1 also found slow), so it only runs when =1. Lane-groups INT4
# (moe_int4.cu GROUPS_FUSE_SILU): each warp's "rows g" 8 gate rows and its "rows g + 8" the matching up rows,
# one walk of K (as many warps as the plain form); s11 D2 (H200, Kimi-K2 layer) 200.0 -> 200.3 /
# 2609.5 -> 2652.7 us at batch 1 / 64 (gate_up + silu 43.7 + 2.9 -> 44.4 us at batch 1).
GEMV_SILU_ENV = "OPENINFER_MOE_GEMV_SILU"
# Lane-groups INT4 gate_up with SiLU·mul fused by default (unset) up to this many slots per expert (a batch-1 step:
# 8 / 384): s12 D2 / D2b (H200, Kimi-K2 layer, results/kimi_layer_b1_kimi13_d2*.json) gate_up + silu_mul 43.3 + 2.7
# -> 44.6 and 43.5 + 2.8 -> 44.9 us by op, step span 200.5 -> 199.2 and 198.8 / 196.4 -> 195.4 us; at 64 tokens
# (1.3 slots per expert) slower (1,531.5 + 4.2 -> 1,573.6 us), so not there. =0 never, =1 at any size.
LANE_GROUPS_SILU_MAX_SLOTS = 0.5


def gemv_silu_kernel(x: cupy.ndarray, gate_up: ExpertLinear, grouping: ExpertGroupingDevice) -> str | None:
    """The decode GEMV that would run ``gate_up`` for this step where it fuses SiLU·mul: moe_gemv_wide
    unless $OPENINFER_MOE_GEMV_SILU=0, moe_gemv_int4_groups (lane-groups INT4, I a multiple of 8) up to
    LANE_GROUPS_SILU_MAX_SLOTS slots per expert unless =0 and at any size with =1, a tiled INT4 GEMV with a
    register ring (I a multiple of 16) only with =1; aligned rows; else None."""
    explicit = os.environ.get(GEMV_SILU_ENV, "") != ""
    if not _switch(GEMV_SILU_ENV, default=True) or gate_up.out_features % 2 or not gate_up.gemv_ready(x):
        return None
    per_expert = int(grouping.sorted_slots.size) / gate_up.num_experts
    name = layout_gemv(gate_up, choose_gemv(per_expert, True, gate_up.format), None, per_expert,
                       one_token=int(grouping.sorted_slots.size) == grouping.top_k, fused=True)
    defines = GEMV_KERNELS.get(name, {}) if name is not None else {}
    if name in GROUPS_GEMVS and gate_up.layout == "lane_groups":  # =1 always; unset: up to LANE_GROUPS_SILU_MAX_SLOTS
        wanted = explicit or per_expert <= LANE_GROUPS_SILU_MAX_SLOTS
        return name if wanted and gate_up.out_features % 16 == 0 else None
    if name in TILED_GEMVS and gate_up.layout == "tiled":  # only when asked for: slower (see GEMV_SILU_ENV)
        return (name if explicit and "TILED_STAGES" not in defines and "TILED_PAIR" not in defines
                and gate_up.out_features % 32 == 0 else None)
    return name if "WIDE_COLUMNS" in defines and defines["WIDE_COLUMNS"] % 2 == 0 else None


def gate_up_silu_gemv(x: cupy.ndarray, gate_up: ExpertLinear, grouping: ExpertGroupingDevice,
                      name: str) -> cupy.ndarray:
    """``silu_mul(grouped_gemm(x, gate_up, grouping, gather=True))`` as one decode GEMV ``name``
    (``gemv_silu_kernel``'s): ``[T·k, I]`` in expert order."""
    num_slots, inter = int(grouping.sorted_slots.size), gate_up.out_features // 2
    out = cupy.empty((num_slots, inter), dtype=cupy.uint16)
    if not num_slots:
        return out
    args = (cupy.ascontiguousarray(x), grouping.sorted_slots, np.int32(grouping.top_k), gate_up.data,
            NULL if gate_up.scale is None else gate_up.scale, grouping.tile_expert, grouping.tile_row,
            grouping.num_tiles, grouping.offsets, np.int32(0), out, np.int32(gate_up.out_features),
            np.int32(gate_up.in_features))
    defines = GEMV_KERNELS[name]
    if defines.get("TILED_PAIR") or "TILED_STAGES" in defines:
        raise ValueError(f"the decode GEMV {name!r} has no fused SiLU·mul form (the register-ring tiled ones and "
                         "moe_gemv_wide do; see gemv_silu_kernel)")
    if name in GROUPS_GEMVS:  # moe_int4.cu: each warp 8 gate rows and their 8 up rows, 8 output columns
        if gate_up.layout != "lane_groups":
            raise ValueError(f"the decode GEMV {name!r} reads lane-groups INT4 weights; this gate_up's layout is "
                             f"{gate_up.layout!r}")
        columns = MMA_GEMV_WARPS // defines.get("GROUPS_KSPLIT", 1) * 8
        fused = {k: v for k, v in defines.items() if k != "GROUPS_ROW_STREAM"}  # one column block a block
        _launch_groups((-(-inter // columns), grouping.max_tiles), args, {**fused, "GROUPS_FUSE_SILU": 1},
                       gate_up.in_features)
    elif name in TILED_GEMVS:
        columns = MMA_GEMV_WARPS * MMA_GEMV_COLUMNS
        gate_up._kernel("moe_gemv_int4_tiled", **{**defines, "TILED_ROW_BLOCKS": 1, "TILED_FUSE_SILU": 1})(
            (-(-inter // columns), grouping.max_tiles), (MMA_GEMV_WARPS * 32,), args)
    else:
        columns = WIDE_WARPS * defines["WIDE_COLUMNS"] // 2
        gate_up._kernel("moe_gemv_wide", **defines, WIDE_FUSE_SILU=1)(
            (-(-inter // columns), grouping.max_tiles), (WIDE_WARPS * 32,), args)
    return out


def sm90_routed(x: cupy.ndarray, gate_up: ExpertLinear, grouping: ExpertGroupingDevice) -> bool:
    """Whether ``routed_experts`` runs both projections on the Hopper kernel (the down projection last)."""
    return forced_gemv_kernel() is None and sm90_experts(x, gate_up, int(grouping.sorted_slots.size), True)


def routed_experts(backend, x: cupy.ndarray, gate_up: ExpertLinear, down: ExpertLinear,
                   grouping: ExpertGroupingDevice, after_gate_up: Callable[[], None] | None = None) -> cupy.ndarray:
    """The experts' rows in expert order, ``[T·k, H]``: gate_up (gathering token rows), SwiGLU, down,
    each by the kernel the step's slots per expert and the switches choose (``moe_forward``'s middle).
    ``after_gate_up``: called between the gate_up's launches and the down projection's."""
    sm90_gate_up = sm90_routed(x, gate_up, grouping)
    if sm90_gate_up:  # the grouping's kernel ran last on this stream (OPENINFER_MOE_GATE_UP_PDL)
        activated = grouped_gemm_sm90(x, gate_up, grouping, True, fuse_silu=True, after_grouping=True)
    elif pipelined_gate_up(x, gate_up, grouping, backend.blas):
        activated = fused_gate_up_silu(x, gate_up, grouping)
    elif (silu_gemv := gemv_silu_kernel(x, gate_up, grouping)) is not None:
        activated = gate_up_silu_gemv(x, gate_up, grouping, silu_gemv)
    else:
        activated = backend.silu_mul(grouped_gemm(x, gate_up, grouping, gather=True, blas=backend.blas))
    if after_gate_up is not None:
        after_gate_up()
    # after the Hopper gate_up (launched once the grouping completed) down may overlap its last wave
    # (OPENINFER_MOE_SM90_PDL)
    # (not across the event after_gate_up records)
    return grouped_gemm(activated, down, grouping, gather=False, blas=backend.blas,
                        overlap_previous=sm90_gate_up and after_gate_up is None)
