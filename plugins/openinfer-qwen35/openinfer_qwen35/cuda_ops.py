"""The CUDA plan's Qwen3.5 ops: launchers for ``kernels/*.cu`` (bf16, CuPy).

One cached loader compiles each source per key-head dim (``-DDK=...``: state columns live in
registers, mma tiles are sized by it); the fused decode step also per conv width
(``-DCONV_WIDTH=...``: its window loops unroll into registers). Every launcher checks its
inputs and raises ``ValueError`` naming what was wrong. Imported only when the model runs on
the cuda backend.

A GDN layer's core (``delta_net``) takes one of three paths per step::

    decode (one token per sequence)   gdn_decode_step: conv + window + gates + delta rule +
                                      gated norm in one kernel (captured in the decode graphs);
                                      OPENINFER_QWEN35_GDN_DECODE=vec4 (the default,
                                      DEFAULT_DECODE_KERNEL): the step with the token's scalars
                                      read beside the state and the state by 16-byte accesses
                                      (a column's partial sums in another order: fp32 rounding
                                      apart from the others); =coalesced: 4-byte accesses, a
                                      column's threads dv apart (128-byte state rows a warp);
                                      =early_loads: adjacent threads; =plain: neither (the same
                                      bits, those three); =bulk: vec4 with the head's state tile
                                      moved by one bulk copy each way through shared memory
                                      (vec4's bits)
    prefill, longest row >= 8 tokens  OPENINFER_QWEN35_GDN_PREFILL (DEFAULT_PREFILL_KERNELS:
                                      chunked_split_f16, issue #17's accuracy; grouped_staged
                                      the fast, less accurate opt-out) =plain: gdn_conv1d, gdn_conv_state,
                                      gdn_chunk_prepare, gdn_chunk_scan (tensor cores, chunks of
                                      64), gdn_gated_norm; =staged: gdn_conv1d_vec (8 channels
                                      and 16 tokens a thread), gdn_chunk_prepare_staged (every
                                      global read issued first) and gdn_gated_norm_warp (a warp
                                      per token and head), the same bits; =split: that, with the
                                      scan split in gdn_chunk_states (the sequential state walk
                                      alone) and gdn_chunk_output (O for every chunk at once;
                                      the same bits); =split_rows: that, and a mixed step's
                                      one-token rows through gdn_delta_rule_rows (token by
                                      token) instead of a one-row chunk each (bf16 tolerance);
                                      =blocked: split_rows with gdn_chunk_prepare_blocked (the
                                      triangular solve by 16 x 16 blocks; bf16 tolerance);
                                      =registers: blocked with gdn_chunk_states_registers (the
                                      walk's state in mma accumulator registers, a chunk's W /
                                      K / U loaded a chunk ahead; key head dims up to 128; steps
                                      too small to fill the SMs keep gdn_chunk_states);
                                      =fused: registers with the gated norm in the output kernel
                                      (gdn_chunk_output_norm; one-token rows: gdn_gated_norm_rows);
                                      =grouped: registers with gdn_chunk_prepare_grouped (a block
                                      per chunk and key head for its group of value heads: q / k
                                      normed and their scores once; T scaled into the A operands,
                                      V and K as stored; key head dims 64 / 128; bf16 tolerance);
                                      =grouped_mma: grouped with the triangular solve's block
                                      products on tensor cores (hi / lo bf16 splits: ~16 bits);
                                      =grouped_conv: grouped_mma with the conv1d + SiLU inside
                                      the prepare (gdn_chunk_prepare_grouped_conv reads the
                                      projection and the old conv windows; gdn_conv_state after
                                      it; one-token rows by gdn_conv1d_vec_rows): no conv_out
                                      round trip for the chunked rows; =grouped_out: that with
                                      gdn_chunk_output_staged (a block's Q, P, S^T and V' loaded
                                      at once, V' as the row-major B operand: gdn_chunk_output's
                                      bits); =grouped_staged (the default before session 12): grouped_mma with
                                      gdn_chunk_output_staged; =grouped_coalesced: that with W / U
                                      staged through shared memory and stored as 16-byte row
                                      pieces (its bits); =grouped_f16: grouped_staged compiled
                                      with fp16 instead of bf16 mma operands and intermediates
                                      (q / k normed, W, U, P, S^T, V'; GDN_F16_OPERANDS): 8x
                                      less error in the layer's output, but the teacher-forced
                                      test vs HF only 0.0173 -> 0.0138 (the token-by-token
                                      kernels: 0.0074): that metric saturates, see issue #17 and
                                      tests/plugins/qwen35/gdn_teacher_forced_emulation.py;
                                      all seven with
                                      gdn_gated_norm_vec (8 channels a thread, 16-byte accesses;
                                      the norm's sum in another order); =chunked_fp32 (opt-in,
                                      key head dims <= 128): gdn_conv1d_vec,
                                      gdn_chunk_prepare_fp32 and gdn_chunk_walk_fp32 (the chunk
                                      algorithm in fp32 on CUDA cores: no 16-bit operand, the
                                      token-by-token kernels' bf16 output nearly everywhere),
                                      gdn_gated_norm_vec — the teacher-forced test at the
                                      token-by-token level (H200, D2 2026-11-24: 0.0071 / 0.0300
                                      vs recurrent 0.0074 / 0.0305, grouped_staged 0.0173 / 0.059)
                                      but 11x grouped_staged's layer time at 8 x 1k (8.61 vs
                                      0.776 ms), 4.6x at 1 x 1k: an accuracy reference;
                                      =chunked_split (opt-in): gdn_conv1d_vec,
                                      gdn_chunk_prepare_split and gdn_chunk_walk_split (the
                                      same on tensor cores: q / k products on the raw bf16
                                      rows, every other operand fp32 split into bf16 hi / mid /
                                      lo parts; fp32 intermediates; one-token rows by
                                      gdn_delta_rule_rows), gdn_gated_norm_vec — the
                                      teacher-forced test at the token-by-token level (H200,
                                      D2 2026-11-24 session 11: 0.0075 / 0.0308 vs
                                      grouped_staged 0.0173 / 0.0590) at 1.85x grouped_staged's
                                      layer time at 8 x 1k (1.545 vs 0.833 ms: prepare 0.472,
                                      walk 0.704), 1.04x at 1 x 1k (0.367 vs 0.353), 0.61x at
                                      1 x 128 (0.198 vs 0.323): opt-in until the 8 x 1k cost
                                      is within 1.3x; =chunked_split_f16 (the default):
                                      gdn_chunk_prepare_split_f16 and gdn_chunk_walk_split_f16
                                      (the same chain on fp16 hi / lo operand parts, the lo
                                      part scaled by 2^11: 3 mmas for a product of two split
                                      operands where bf16 parts take 6; the solve's block
                                      products on tensor cores; a chunk's reads in one cp.async
                                      round trip; W and P stored pre-split) — teacher-forced
                                      0.0071 / 0.0306 (H200, D2 2026-11-24 session 12), layer
                                      1.46x grouped_staged's at 8 x 1k (1.192 vs 0.817 ms;
                                      chunked_split 1.78x), 1.05x at 1 x 1k, faster from 1 x
                                      512 down, before its prepare's cp.async reads (its walk
                                      with W / P loaded where used, 3 blocks an SM, and with the
                                      next chunk's reads during this one's products measured
                                      slower, sessions 12 D2 / D3: removed)
    otherwise                         gdn_conv1d, gdn_conv_state, gdn_delta_rule (token by
                                      token), gdn_gated_norm

``OPENINFER_QWEN35_GDN_KERNELS=recurrent`` selects the earlier kernels for every step (the
token-by-token delta rule for prefill, four kernels for decode): the baseline the benchmark
compares against. Shapes the fast kernels do not take (key head dim not a multiple of 64,
value head dim not a multiple of 32) use them too.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

import cupy
import numpy as np

from openinfer.backend.cuda import loader
from openinfer.backend.cuda.weight_upload import upload_vector
from openinfer_qwen35.config import Qwen35Config
from openinfer_qwen35.gated_deltanet import CHUNK_SIZE, chunk_layout
from openinfer_qwen35.kernel_plan import KernelPlan
from openinfer_qwen35.state import SnapshotSplit, StepSequences, step_snapshots
from openinfer_qwen35.weights import DeltaNetWeights

KERNEL_DIR = Path(str(resources.files("openinfer_qwen35") / "kernels"))
SOURCES = {"gated_deltanet.cu": ("gdn_conv1d", "gdn_conv1d_vec", "gdn_conv1d_vec_rows", "gdn_conv_state", "gdn_conv_snapshot",
                                 "gdn_delta_rule",
                                 "gdn_delta_rule_rows",
                                 "gdn_gated_norm",
                                 "gdn_gated_norm_warp", "gdn_gated_norm_vec", "gdn_gated_norm_rows", "sigmoid_mul", "sigmoid_mul_vec", "zero_centred_rms_norm",
                                 "zero_centred_add_rms_norm", "zero_centred_add_rms_norm_vec"),
           "gdn_chunked.cu": ("gdn_chunk_prepare", "gdn_chunk_prepare_staged", "gdn_chunk_prepare_blocked",
                              "gdn_chunk_prepare_grouped", "gdn_chunk_prepare_grouped_mma",
                              "gdn_chunk_prepare_grouped_conv", "gdn_chunk_prepare_grouped_coalesced",
                              "gdn_chunk_scan", "gdn_chunk_states", "gdn_chunk_states_registers",
                              "gdn_chunk_states_snapshot", "gdn_chunk_states_registers_snapshot",
                              "gdn_chunk_output", "gdn_chunk_output_norm", "gdn_chunk_output_staged"),
           "gdn_chunked_fp32.cu": ("gdn_chunk_prepare_fp32", "gdn_chunk_walk_fp32"),
           "gdn_chunked_split.cu": ("gdn_chunk_prepare_split", "gdn_chunk_walk_split", "gdn_chunk_prepare_split_f16",
                                    "gdn_chunk_walk_split_f16", "gdn_chunk_walk_split_f16_snapshot"),
           "gdn_decode.cu": ("gdn_decode_step", "gdn_decode_step_early_loads", "gdn_decode_step_coalesced",
                             "gdn_decode_step_vec4", "gdn_decode_step_bulk")}
SOURCE_OF = {name: source for source, names in SOURCES.items() for name in names}
MAX_CONV_WIDTH = 9  # gdn_conv_state / gdn_decode_step keep K-1 <= 8 old inputs in registers
MAX_KEY_HEAD_DIM = 256
SPLIT = 4  # threads per value channel in gdn_delta_rule (each holds DK / SPLIT state rows)
TILE_DV = 32  # value channels per gdn_delta_rule block (a head spreads over dv / 32 blocks)
SCAN_TILE = 32  # value channels per gdn_chunk_scan block (gdn_chunked.cu)
CONV_TOKENS = 16  # tokens a thread of gdn_conv1d_vec (gated_deltanet.cu)
CHUNKED_MIN_TOKENS = 8  # a prefill step whose longest row is shorter runs the token-by-token kernel
MAX_FUSED_DECODE_ROWS = 1024  # decode batches up to this many rows take gdn_decode_step
FUSED_DECODE_MAX_THREADS = 512  # gdn_decode_step's __launch_bounds__ (two blocks per SM)
KERNELS_ENV = "OPENINFER_QWEN35_GDN_KERNELS"
DECODE_ENV = "OPENINFER_QWEN35_GDN_DECODE"  # a key of DECODE_KERNELS: which fused decode kernel
DECODE_KERNELS = {"plain": "gdn_decode_step", "early_loads": "gdn_decode_step_early_loads",
                  "coalesced": "gdn_decode_step_coalesced", "vec4": "gdn_decode_step_vec4",
                  "bulk": "gdn_decode_step_bulk"}
VEC4_MAX_KEY_HEAD_DIM = 128  # gdn_decode_step_vec4 holds DK / 4 state floats a thread (two blocks per SM)
ROW_KERNELS_ENV = "OPENINFER_QWEN35_ROW_KERNELS"  # "vec" (default) | "plain": sigmoid_mul and add_rms_norm
PREFILL_ENV = "OPENINFER_QWEN35_GDN_PREFILL"  # a key of PREFILL_KERNELS: the chunked prefill's kernels


class PrefillKernels(NamedTuple):
    conv: str  # the varlen conv (every prefill step)
    prepare: str  # the chunked path's per-chunk kernel
    split_scan: bool  # the chunk walk as gdn_chunk_states + gdn_chunk_output instead of gdn_chunk_scan
    norm: str  # the gated RMSNorm (every prefill step)
    # a chunked step's one-token rows (a mixed step's decodes) through gdn_delta_rule_rows instead
    # of a one-row chunk each (a whole chunk's work: a prepare block a head, a scan walk a tile)
    rows_apart: bool = False
    states: str = "gdn_chunk_states"  # the split scan's state walk
    # the split scan's output: gdn_chunk_output_norm writes the gated-normed rows itself (then only a
    # step's one-token rows go through gdn_gated_norm_rows)
    output: str = "gdn_chunk_output"
    # gdn_chunked.cu compiled with GDN_F16_OPERANDS: the intermediates and every mma in fp16 instead of
    # bf16 (only with F16_OPERAND_KERNELS' prepare / output and either state walk; else bf16)
    f16_operands: bool = False


PREFILL_KERNELS = {"plain": PrefillKernels("gdn_conv1d", "gdn_chunk_prepare", False, "gdn_gated_norm"),
                   "staged": PrefillKernels("gdn_conv1d_vec", "gdn_chunk_prepare_staged", False, "gdn_gated_norm_warp"),
                   "split": PrefillKernels("gdn_conv1d_vec", "gdn_chunk_prepare_staged", True, "gdn_gated_norm_warp"),
                   "split_rows": PrefillKernels("gdn_conv1d_vec", "gdn_chunk_prepare_staged", True,
                                                "gdn_gated_norm_warp", True),
                   "blocked": PrefillKernels("gdn_conv1d_vec", "gdn_chunk_prepare_blocked", True,
                                             "gdn_gated_norm_warp", True),
                   "registers": PrefillKernels("gdn_conv1d_vec", "gdn_chunk_prepare_blocked", True,
                                               "gdn_gated_norm_warp", True, "gdn_chunk_states_registers"),
                   "fused": PrefillKernels("gdn_conv1d_vec", "gdn_chunk_prepare_blocked", True, "gdn_gated_norm_warp",
                                           True, "gdn_chunk_states_registers", "gdn_chunk_output_norm"),
                   "grouped": PrefillKernels("gdn_conv1d_vec", "gdn_chunk_prepare_grouped", True, "gdn_gated_norm_vec",
                                             True, "gdn_chunk_states_registers"),
                   "grouped_mma": PrefillKernels("gdn_conv1d_vec", "gdn_chunk_prepare_grouped_mma", True,
                                                 "gdn_gated_norm_vec", True, "gdn_chunk_states_registers"),
                   "grouped_conv": PrefillKernels("gdn_conv1d_vec", "gdn_chunk_prepare_grouped_conv", True,
                                                  "gdn_gated_norm_vec", True, "gdn_chunk_states_registers"),
                   "grouped_out": PrefillKernels("gdn_conv1d_vec", "gdn_chunk_prepare_grouped_conv", True,
                                                 "gdn_gated_norm_vec", True, "gdn_chunk_states_registers",
                                                 "gdn_chunk_output_staged"),
                   "grouped_staged": PrefillKernels("gdn_conv1d_vec", "gdn_chunk_prepare_grouped_mma", True,
                                                    "gdn_gated_norm_vec", True, "gdn_chunk_states_registers",
                                                    "gdn_chunk_output_staged"),
                   "grouped_coalesced": PrefillKernels("gdn_conv1d_vec", "gdn_chunk_prepare_grouped_coalesced", True,
                                                       "gdn_gated_norm_vec", True, "gdn_chunk_states_registers",
                                                       "gdn_chunk_output_staged"),
                   "grouped_f16": PrefillKernels("gdn_conv1d_vec", "gdn_chunk_prepare_grouped_mma", True,
                                                 "gdn_gated_norm_vec", True, "gdn_chunk_states_registers",
                                                 "gdn_chunk_output_staged", f16_operands=True),
                   "chunked_fp32": PrefillKernels("gdn_conv1d_vec", "gdn_chunk_prepare_fp32", False,
                                                  "gdn_gated_norm_vec"),
                   # a mixed step's one-token rows token by token (gdn_delta_rule_rows: fp32 state, the
                   # accuracy reference) instead of a one-row chunk each
                   "chunked_split": PrefillKernels("gdn_conv1d_vec", "gdn_chunk_prepare_split", False,
                                                   "gdn_gated_norm_vec", True, "gdn_chunk_walk_split"),
                   # chunked_split with fp16 hi / lo operand parts (lo scaled by 2^11) instead of bf16 hi / mid / lo
                   # and the solve's block products on tensor cores
                   "chunked_split_f16": PrefillKernels("gdn_conv1d_vec", "gdn_chunk_prepare_split_f16", False,
                                                       "gdn_gated_norm_vec", True, "gdn_chunk_walk_split_f16")}
FP32_PREPARE_KERNEL = "gdn_chunk_prepare_fp32"  # gdn_chunked_fp32.cu: its own walk (gdn_chunk_walk_fp32)
FP32_CHUNKED_MAX_KEY_HEAD_DIM = 128  # its walk's shared q / k / W tiles [64][DK + 1] fp32 (and S, P, U) fit 227 KiB
FP32_WALK_TILE = 32  # value channels a gdn_chunk_walk_fp32 block
FP32_THREADS = 256
SPLIT_PREPARE_KERNEL = "gdn_chunk_prepare_split"  # gdn_chunked_split.cu: its own walk (gdn_chunk_walk_split)
SPLIT_PREPARE_KERNELS = (SPLIT_PREPARE_KERNEL, "gdn_chunk_prepare_split_f16")  # bf16 / fp16 operand parts
SPLIT_WALK_TILE = 32  # value channels a gdn_chunk_walk_split block
# the split chain's walks (PrefillKernels.states): bf16 hi / mid / lo operand parts, or fp16 hi / lo
SPLIT_WALK_KERNELS = ("gdn_chunk_walk_split", "gdn_chunk_walk_split_f16")
SPLIT_THREADS = 128
# the kernels of gdn_chunked.cu whose operands follow GDN_F16_OPERANDS (the others assume bf16 ones)
F16_OPERAND_KERNELS = frozenset({"gdn_chunk_prepare_grouped_mma", "gdn_chunk_states", "gdn_chunk_states_registers",
                                 "gdn_chunk_states_snapshot", "gdn_chunk_states_registers_snapshot",
                                 "gdn_chunk_output_staged"})
VEC_NORM_VALUE_HEAD_DIMS = (64, 128, 256)  # gdn_gated_norm_vec: a head's dv / 8 lanes within a warp, a power of two
CONV_PREPARE_KERNEL = "gdn_chunk_prepare_grouped_conv"  # convolves its rows itself (conv width compiled in)
GROUPED_PREPARE_KERNELS = ("gdn_chunk_prepare_grouped", "gdn_chunk_prepare_grouped_mma", CONV_PREPARE_KERNEL,
                           "gdn_chunk_prepare_grouped_coalesced")  # grid (chunks, key heads)
GROUPED_PREPARE_KEY_HEAD_DIMS = (64, 128)  # their q / k rows' 16-byte vectors within a warp
OUTPUT_NORM_MAX_VALUE_HEAD_DIM = 128  # gdn_chunk_output_norm keeps a row's O over dv / 32 tiles in registers
REGISTER_STATES_MAX_KEY_HEAD_DIM = 128  # gdn_chunk_states_registers: DK / 2 state floats a thread
STAGED_PREPARE_KERNELS = ("gdn_chunk_prepare_staged", "gdn_chunk_prepare_blocked")  # the staged shared-memory carve
# split_rows by measurement (H200, E2 2026-11-23, one GDN layer of the 4B shape, CUDA events per
# kernel): 8 prompts x 1k + 48 decode rows (the 64-stream burst's mixed steps) 3.40 -> 2.26 ms,
# 8 x 1k 2.79 -> 2.14 ms, 1 x 1k 0.54 -> 0.41 ms (benchmarks/results/gpu_qwen35_gdn_kernels_e2_h200.json);
# the same bits as plain but a mixed step's one-token rows (tests/gpu/test_qwen35_kernels.py).
# blocked by measurement (H200, E1 2026-11-24, merged main bce1c73, the same benchmark): the prepare
# kernel 0.607 -> 0.486 ms at 8 x 1k (1.25x), 0.118 -> 0.098 ms at 1 x 1k; the layer's call 1.42 -> 1.30
# ms at 8 x 1k, 1.55 -> 1.43 ms at 8 x 1k + 48 decode rows (benchmarks/results/gpu_qwen35_gdn_kernels.json);
# within bf16 tolerance of NumPy (tests/gpu/test_qwen35_kernels.py). =split_rows (the solve column by
# column) or =plain reverts.
# registers by measurement (H200, E1 2026-11-24, merged main 561353f, one GDN layer of the 4B shape):
# the state walk 0.356 -> 0.193 ms at 8 x 1k tokens (1.84x), the layer 1.300 -> 1.134 ms (1.15x), 1.479
# -> 1.270 ms with 48 decode rows (1.16x); the 64-stream burst's mixed step (8 x 1008 + 48 decodes,
# op ledger) 128.6 -> 125.2 ms (results/gpu_qwen35_gdn_prefill.json, gpu_qwen35_step_ledger.json);
# blocked's bits (tests/gpu/test_qwen35_kernels.py). Steps too small to fill the SMs with its widest
# blocks keep gdn_chunk_states (1 x 1k: 0.062 vs 0.075 ms). =blocked reverts.
# grouped_staged by measurement (H200, E1 2026-11-24 session 8, merged main, one GDN layer of the 4B shape,
# CUDA events per kernel; benchmarks/results/gpu_qwen35_gdn_prefill_s8e1_h200.json): the grouped prepare with the
# tensor-core solve (grouped_mma) 0.482 -> 0.238 ms at 8 x 1k (2.03x), the layer 1.132 -> 0.853 ms (1.33x),
# 1.274 -> 0.982 ms with 48 decode rows (1.30x), 1 x 1k 1.20x; the 64-stream burst's mixed step (op ledger,
# 8 x 1008 + 48 decodes) 126.7 -> 119.6 ms, its delta_net 30.6 -> 23.4 ms (gpu_qwen35_step_ledger_s8e1_h200.json);
# gdn_chunk_output_staged 0.149 -> 0.115 ms at 8 x 1k (1.30x; gdn_chunk_output's bits). The conv inside
# the prepare (grouped_conv: 0.440 ms for prepare + conv against 0.238 + 0.144) measured slower: opt-in.
# bf16 tolerance of registers (W / U and the norm's sum rounded at other points): GPU kernel tests vs NumPy,
# teacher-forced vs HF (grouped_out, grouped_mma's bits: mean 0.0173, p99 0.059 within 0.06 / 0.20).
# =registers reverts.
# chunked_split_f16 by issue #17's accuracy at a measured cost (H200, session 12): teacher-forced vs HF bf16 0.0071 /
# 0.0306 (the token-by-token kernels 0.0074 / 0.0305; grouped_staged 0.0173 / 0.0590); one GDN layer's prefill 1.46x
# grouped_staged's at 8 x 1k (1.192 vs 0.817 ms, D2, before its prepare's one-round-trip reads), 1.05x at 1 x 1k,
# faster from 1 x 512 down (results: D2 gpu_qwen35_gdn_prefill); the 16 / 64-stream bursts (lead's D2b A/B, one
# lease, in-step snapshots on) 2,591 / 4,297 vs 2,620 / 4,441 tok/s (-1 % / -3 %). =grouped_staged reverts.
DEFAULT_PREFILL_KERNELS = "chunked_split_f16"
# early_loads by measurement (H200, D3 2026-11-23, one GDN layer, graph replay): 1.03-1.06x plain at
# 1-256 rows (64 rows 133.0 -> 129.4 us), the same bits (tests/gpu/test_qwen35_kernels.py)
# coalesced by measurement (H200, E3 2026-11-24, main e0c0aad, graph replay): 1.40 / 1.23 / 1.15x plain
# and 1.34 / 1.19 / 1.08x early_loads at 16 / 64 / 256 rows (64 rows 129.2 -> 108.8 us, 2.47 TB/s of
# state), the same bits (benchmarks/results/gpu_qwen35_gdn_kernels_e3_h200.json).
# vec4 by measurement (H200, E1 2026-11-24, merged main bce1c73, graph replay of 24 calls): 1.19 / 1.20 /
# 1.22 / 1.28x coalesced at 1 / 16 / 64 / 256 rows (64 rows 109.1 -> 89.1 us: the state at 3.01 TB/s
# of the 4.20 TB/s a copy reached in the same run; 256 rows 429.7 -> 334.6 us, 3.21 TB/s), 1.50x plain
# at 64 rows (benchmarks/results/gpu_qwen35_gdn_kernels.json); within fp32 rounding of plain, not its
# bits (tests/gpu/test_qwen35_kernels.py). OPENINFER_QWEN35_GDN_DECODE=coalesced reverts.
DEFAULT_DECODE_KERNEL = "vec4"


_extra_defines: dict[str, int] = {}  # defines_added's: a diagnostic build's


@contextlib.contextmanager
def defines_added(**defines: int) -> Iterator[None]:
    """Within: every kernel built with the extra ``-DNAME=value`` defines (a benchmark's diagnostic
    build); kernels with other defines are other modules, so nothing outside the block sees them."""
    previous = dict(_extra_defines)
    _extra_defines.update(defines)
    kernel.cache_clear()
    try:
        yield
    finally:
        _extra_defines.clear()
        _extra_defines.update(previous)
        kernel.cache_clear()


def _kernel_key(name: str, key_head_dim: int = 128, conv_width: int = 0, f16_operands: bool = False) -> Any:
    """The core loader's key of kernel ``name``: its source file and defines (see ``kernel``)."""
    defines = {"DK": key_head_dim, "SPLIT": SPLIT, **_extra_defines}
    if conv_width:
        defines["CONV_WIDTH"] = conv_width
    if f16_operands:
        defines["GDN_F16_OPERANDS"] = 1
    return loader.kernel_key(KERNEL_DIR / SOURCE_OF[name], name, **defines)


@functools.cache
def kernel(name: str, key_head_dim: int = 128, shared_bytes: int = 0, conv_width: int = 0,
           f16_operands: bool = False) -> cupy.RawKernel:
    """Kernel ``name`` compiled for ``key_head_dim`` (and ``conv_width`` when non-zero: a
    compile-time conv width; ``f16_operands``: gdn_chunked.cu's intermediates in fp16, only
    F16_OPERAND_KERNELS); ``shared_bytes`` above 48 KiB of dynamic shared memory is opted
    into once here. Built by the core loader, one kernel a module (``start_builds`` begins them
    all in the background before the weights load)."""
    if f16_operands and name not in F16_OPERAND_KERNELS:
        raise ValueError(f"{name} takes bf16 operands only (fp16 ones: {sorted(F16_OPERAND_KERNELS)})")
    source, _, defines = _kernel_key(name, key_head_dim, conv_width, f16_operands)
    function = loader.kernel(source, name, **dict(defines))
    if shared_bytes > 48 * 1024:
        function.max_dynamic_shared_size_bytes = shared_bytes
    return function


def use_recurrent_kernels() -> bool:
    """Whether ``OPENINFER_QWEN35_GDN_KERNELS=recurrent`` asks for the earlier kernels."""
    return os.environ.get(KERNELS_ENV, "").strip().lower() == "recurrent"


def decode_kernel(config: Qwen35Config | None = None) -> str:
    """The fused decode kernel: ``OPENINFER_QWEN35_GDN_DECODE`` (a key of ``DECODE_KERNELS``),
    else ``DEFAULT_DECODE_KERNEL``; read at each eager launch or capture, like
    ``use_recurrent_kernels`` (a graph keeps the kernel it was captured with). The coalesced
    kernel takes value head dims that are multiples of 32 (else early_loads runs); vec4 also key
    head dims that are multiples of 16 up to VEC4_MAX_KEY_HEAD_DIM (else coalesced runs), and so
    does bulk (the vec4 step with the state tile moved by bulk copies through shared memory)."""
    choice = os.environ.get(DECODE_ENV, "").strip().lower() or DEFAULT_DECODE_KERNEL
    if choice not in DECODE_KERNELS:
        raise ValueError(f"{DECODE_ENV}={choice!r}: expected one of {sorted(DECODE_KERNELS)}")
    return decode_kernel_for(choice, config)


def decode_kernel_for(choice: str, config: Qwen35Config | None) -> str:
    """The kernel that runs for decode choice ``choice`` (a key of ``DECODE_KERNELS``) at ``config``'s shapes."""
    if config is not None:
        dk = config.linear_key_head_dim
        if choice in ("vec4", "bulk") and (dk % 16 or dk > VEC4_MAX_KEY_HEAD_DIM):
            choice = "coalesced"
        if choice in ("coalesced", "vec4", "bulk") and config.linear_value_head_dim % 32:
            choice = "early_loads"
    return DECODE_KERNELS[choice]


_kernel_events: list | None = None  # (name, start, stop) of each launch while kernel_timer() is active


@contextlib.contextmanager
def kernel_timer() -> Iterator[dict[str, float]]:
    """Device time per kernel of the ``delta_net`` calls made inside the block (eager launches
    only): each launch is bracketed by CUDA events, and on exit the yielded dict maps each
    kernel name to its summed milliseconds (the benchmark's per-kernel breakdown)."""
    global _kernel_events
    if _kernel_events is not None:
        raise RuntimeError("kernel_timer() blocks do not nest")
    _kernel_events = []
    times: dict[str, float] = {}
    try:
        yield times
    finally:
        events, _kernel_events = _kernel_events, None
        if events:
            events[-1][2].synchronize()
        for name, start, stop in events:
            times[name] = times.get(name, 0.0) + cupy.cuda.get_elapsed_time(start, stop)


def _launch(name: str, function: cupy.RawKernel, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None:
    if _kernel_events is None:
        function(grid, block, args, shared_mem=shared_mem)
        return
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    function(grid, block, args, shared_mem=shared_mem)
    stop.record()
    _kernel_events.append((name, start, stop))


def prefill_kernels(config: Qwen35Config, proj_stride: int) -> PrefillKernels:
    """The prefill path's kernels: ``OPENINFER_QWEN35_GDN_PREFILL`` (a key of ``PREFILL_KERNELS``),
    else ``DEFAULT_PREFILL_KERNELS``; ``OPENINFER_QWEN35_GDN_KERNELS=recurrent`` keeps the plain
    ones. Shapes a fast kernel does not take get the plain one: the 8-channel conv needs conv_dim
    and the projection's row stride in multiples of 8, the staged prepare (a chunk's v rows in
    registers) a value head dim no larger than the key head dim, the warp-per-head norm a value
    head dim that is a multiple of 32 up to 256."""
    choice = os.environ.get(PREFILL_ENV, "").strip().lower() or DEFAULT_PREFILL_KERNELS
    if choice not in PREFILL_KERNELS:
        raise ValueError(f"{PREFILL_ENV}={choice!r}: expected one of {sorted(PREFILL_KERNELS)}")
    plain = PREFILL_KERNELS["plain"]
    if use_recurrent_kernels():
        return plain
    kernels = PREFILL_KERNELS[choice]
    if config.conv_dim % 8 or proj_stride % 8:
        kernels = kernels._replace(conv=plain.conv)
    if kernels.prepare in GROUPED_PREPARE_KERNELS and config.linear_key_head_dim not in GROUPED_PREPARE_KEY_HEAD_DIMS:
        kernels = kernels._replace(prepare=PREFILL_KERNELS["registers"].prepare)
    if config.linear_value_head_dim > config.linear_key_head_dim:
        kernels = kernels._replace(prepare=plain.prepare)
    if kernels.norm == "gdn_gated_norm_vec" and (config.linear_value_head_dim not in VEC_NORM_VALUE_HEAD_DIMS
                                                 or config.conv_dim % 8 or proj_stride % 8):
        kernels = kernels._replace(norm="gdn_gated_norm_warp")
    if config.linear_value_head_dim % 32 or config.linear_value_head_dim > 256:
        kernels = kernels._replace(norm=plain.norm)
    if kernels.output == "gdn_chunk_output_norm" and (kernels.norm != "gdn_gated_norm_warp"
                                                      or config.linear_value_head_dim > OUTPUT_NORM_MAX_VALUE_HEAD_DIM):
        kernels = kernels._replace(output=PrefillKernels._field_defaults["output"])
    if kernels.prepare in SPLIT_PREPARE_KERNELS and config.linear_key_head_dim > REGISTER_STATES_MAX_KEY_HEAD_DIM:
        # the fp16-part walks hold DK / 2 state columns and W's DK / 16 fragments a thread: wider key heads take
        # the bf16-part chain (its prepare with its walk: the fp16-part prepare stores W and P pre-split)
        kernels = kernels._replace(prepare=SPLIT_PREPARE_KERNEL, states=SPLIT_WALK_KERNELS[0])
    if config.linear_key_head_dim > REGISTER_STATES_MAX_KEY_HEAD_DIM:
        kernels = kernels._replace(states=PrefillKernels._field_defaults["states"])
    if kernels.prepare == FP32_PREPARE_KERNEL and config.linear_key_head_dim > FP32_CHUNKED_MAX_KEY_HEAD_DIM:
        kernels = kernels._replace(prepare=plain.prepare)
    return kernels


def chunked_fp32_shared_bytes(dk: int, dv: int) -> tuple[int, int]:
    """gdn_chunk_prepare_fp32's and gdn_chunk_walk_fp32's dynamic shared memory (their carves)."""
    chunk, ld, ldc = CHUNK_SIZE, dk + 1, CHUNK_SIZE + 1
    prepare = 4 * (2 * chunk * ld + chunk * (dv + 1) + 2 * chunk * ldc + 2 * chunk) + 8 * chunk
    walk = 4 * (3 * chunk * ld + chunk * ldc + chunk * (FP32_WALK_TILE + 1) + dk * (FP32_WALK_TILE + 1) + 3 * chunk)
    return prepare, walk


def chunked_split_shared_bytes(dk: int, dv: int, walk: str = "gdn_chunk_walk_split") -> tuple[int, int]:
    """gdn_chunk_prepare_split's and ``walk``'s (of SPLIT_WALK_KERNELS) dynamic shared memory (their carves, in
    order): 75 / 82 KB at the 4B shape (the fp16 walks': 71 KB)."""
    chunk, row_h, row_c = CHUNK_SIZE, dk + 8, CHUNK_SIZE + 8
    rows_then_solve = max(2 * 2 * chunk * row_h, 4 * 2 * chunk * row_c)  # q / k rows, then A and T in their place
    prepare = rows_then_solve + 2 * (dk * row_c + max(dv * row_c, chunk * (dv + 8))) + 4 * 4 * chunk + 8 * chunk
    fp16_parts = walk.startswith("gdn_chunk_walk_split_f16")  # two state planes; q and k as rows
    walk_bytes = (4 * (SPLIT_WALK_TILE * row_c + chunk * (SPLIT_WALK_TILE + 8) + 3 * chunk)
                  + 2 * ((2 if fp16_parts else 3) * SPLIT_WALK_TILE * row_h + chunk * row_h
                         + (chunk * row_h if fp16_parts else dk * row_c)))
    return prepare, walk_bytes


def _round_128(size: int) -> int:
    return -(-size // 128) * 128


def chunk_prepare_shared_bytes(dk: int, dv: int, staged: bool = False) -> int:
    """gdn_chunk_prepare's dynamic shared memory (its carve, in order); ``staged``:
    gdn_chunk_prepare_staged's, whose T copy and (beta exp(c) K)^T reuse the solve's A and T."""
    row_k, row_c, row_f = dk + 8, CHUNK_SIZE + 8, CHUNK_SIZE + 4
    tri, tb, kt = _round_128(CHUNK_SIZE * row_f * 4), _round_128(CHUNK_SIZE * row_c * 2), _round_128(dk * row_c * 2)
    middle = max(2 * tri, tb + kt) if staged else kt + 2 * tri + tb
    return (max(_round_128(CHUNK_SIZE * row_k * 2), _round_128(dv * row_c * 2)) + _round_128(CHUNK_SIZE * row_k * 2)
            + middle + _round_128(CHUNK_SIZE * 8) + _round_128(CHUNK_SIZE * 4) + CHUNK_SIZE * 4)


def chunk_prepare_grouped_shared_bytes(dk: int, dv: int, ratio: int) -> int:
    """gdn_chunk_prepare_grouped's dynamic shared memory (its carve, in order): q then V, k, A, T, c,
    beta, beta exp(c), the group's (``ratio`` value heads') gate inputs and decay parameters."""
    row_k, row_v, row_f = dk + 8, dv + 8, CHUNK_SIZE + 4
    return (max(_round_128(CHUNK_SIZE * row_k * 2), _round_128(CHUNK_SIZE * row_v * 2)) + _round_128(CHUNK_SIZE * row_k * 2)
            + 2 * _round_128(CHUNK_SIZE * row_f * 4) + _round_128(CHUNK_SIZE * 8) + 2 * _round_128(CHUNK_SIZE * 4)
            + _round_128(ratio * CHUNK_SIZE * 2 * 4) + ratio * 2 * 4)


def chunk_scan_shared_bytes(dk: int) -> int:
    """gdn_chunk_scan's dynamic shared memory (its carve, in order)."""
    row_k, row_c = dk + 8, CHUNK_SIZE + 8
    return (_round_128(dk * (SCAN_TILE + 4) * 4) + _round_128(SCAN_TILE * row_k * 2)
            + 3 * _round_128(CHUNK_SIZE * row_k * 2) + _round_128(CHUNK_SIZE * row_c * 2)
            + 2 * _round_128(SCAN_TILE * row_c * 2) + CHUNK_SIZE * 4)


def chunk_states_shared_bytes(dk: int) -> int:
    """gdn_chunk_states' dynamic shared memory (its carve, in order)."""
    row_k, row_c = dk + 8, CHUNK_SIZE + 8
    return (_round_128(dk * (SCAN_TILE + 4) * 4) + _round_128(SCAN_TILE * row_k * 2)
            + 2 * _round_128(CHUNK_SIZE * row_k * 2) + _round_128(SCAN_TILE * row_c * 2) + CHUNK_SIZE * 4)


def register_states_warps(dv: int) -> int:
    """gdn_chunk_states_registers' warps a block (16 value channels each): up to 8 (a head's W / K
    tiles loaded once for 128 channels), dividing dv / 16."""
    return next(warps for warps in (8, 4, 2, 1) if (dv // 16) % warps == 0)


def register_walk_fills_gpu(dv: int, heads: int) -> bool:
    """Whether a step's ``heads`` (sequences x value heads) give the register walk a block for every
    SM — the shape it was measured faster at (H200, E1 2026-11-24: 8 x 1k tokens, the walk 0.356 ->
    0.193 ms); a lone prompt's walk over 2-warp blocks measured slower than gdn_chunk_states (1 x
    1k: 0.062 -> 0.075 ms), so smaller steps keep that."""
    return heads * (dv // (16 * register_states_warps(dv))) >= _multiprocessors()


GROUPED_PREPARE_BLOCKS_PER_SM = 3  # its 70 KiB of shared memory and 168 registers a thread
GROUPED_PREPARE_MAX_HEADS = 8  # value heads a grouped prepare block takes (its gate inputs: 4 entries a thread)


def grouped_prepare_split(num_chunks: int, num_key_heads: int, ratio: int) -> int:
    """Blocks a grouped prepare spreads each key head's value heads over: 1 (the group shares its
    q / k work) when the step's chunks x key heads fill every SM's block slots, else ``ratio`` (a
    block per value head, as the other prepare kernels: a lone 1k prompt's 16 chunks x 16 key heads
    would leave most of the H200's 396 slots empty)."""
    if ratio > GROUPED_PREPARE_MAX_HEADS:
        return ratio
    return 1 if num_chunks * num_key_heads >= GROUPED_PREPARE_BLOCKS_PER_SM * _multiprocessors() else ratio


@functools.cache
def _multiprocessors() -> int:
    return int(cupy.cuda.Device().attributes["MultiProcessorCount"])


def chunk_states_registers_shared_bytes(dk: int, dv: int) -> int:
    """gdn_chunk_states_registers' dynamic shared memory: two buffers of W, K, U and c."""
    row_k, row_u = dk + 8, 16 * register_states_warps(dv) + 8
    return 2 * (2 * _round_128(CHUNK_SIZE * row_k * 2) + _round_128(CHUNK_SIZE * row_u * 2) + CHUNK_SIZE * 4)


def chunk_output_staged_shared_bytes(dk: int, dv: int) -> int:
    """gdn_chunk_output_staged's dynamic shared memory (its carve, in order): Q, P, S^T, V', c."""
    row_k, row_c, row_v = dk + 8, CHUNK_SIZE + 8, dv + 8
    return (_round_128(CHUNK_SIZE * row_k * 2) + _round_128(CHUNK_SIZE * row_c * 2) + _round_128(dv * row_k * 2)
            + _round_128(CHUNK_SIZE * row_v * 2) + CHUNK_SIZE * 4)


def chunk_output_shared_bytes(dk: int) -> int:
    """gdn_chunk_output's dynamic shared memory (its carve, in order)."""
    row_k, row_c = dk + 8, CHUNK_SIZE + 8
    return (_round_128(CHUNK_SIZE * row_k * 2) + _round_128(CHUNK_SIZE * row_c * 2) + _round_128(SCAN_TILE * row_k * 2)
            + _round_128(SCAN_TILE * row_c * 2) + CHUNK_SIZE * 4)


def chunked_supported(config: Qwen35Config) -> bool:
    return config.linear_key_head_dim % 64 == 0 and config.linear_value_head_dim % SCAN_TILE == 0


def fused_decode_threads(config: Qwen35Config) -> int:
    """gdn_decode_step's block: SPLIT threads per value channel and one per conv channel."""
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    return -(-max(dv * SPLIT, 2 * dk + dv) // 32) * 32


def decode_bulk_shared_bytes(dk: int, dv: int) -> int:
    """gdn_decode_step_bulk's dynamic shared memory: the state tile, the partials, deltas, q, k, v (fp32)."""
    return 4 * (dk * dv + 16 * dv + dv + 2 * dk + dv)


def _decode_function(name: str, config: Qwen35Config) -> tuple[cupy.RawKernel, int]:
    """The fused decode kernel ``name`` and its dynamic shared memory (bulk: all of it, with the
    largest shared-memory carve-out so that three blocks fit an SM)."""
    dk, width = config.linear_key_head_dim, config.linear_conv_kernel_dim
    if name != DECODE_KERNELS["bulk"]:
        return kernel(name, dk, 0, width), 0
    shared = decode_bulk_shared_bytes(dk, config.linear_value_head_dim)
    return _bulk_decode_kernel(dk, shared, width), shared


@functools.cache
def _bulk_decode_kernel(dk: int, shared: int, width: int) -> cupy.RawKernel:
    function = kernel(DECODE_KERNELS["bulk"], dk, shared, width)
    function.preferred_shared_memory_carveout = 100  # all 228 KiB: three 75 KiB blocks an SM
    return function


def fused_decode_supported(config: Qwen35Config) -> bool:
    return (fused_decode_threads(config) <= FUSED_DECODE_MAX_THREADS and config.linear_value_head_dim <= 256
            and 2 <= config.linear_conv_kernel_dim <= MAX_CONV_WIDTH)  # compiled in: never an unsupported width


@functools.cache
def _arrivals(device_id: int, size: int) -> cupy.ndarray:
    """gdn_decode_step's per (row, key head) arrival counters: zero between launches (the
    last block of each key head resets its own), so one buffer serves every layer and replay."""
    with cupy.cuda.Device(device_id):
        return cupy.zeros(size, dtype=cupy.int32)


def arrival_counters(config: Qwen35Config) -> cupy.ndarray:
    return _arrivals(cupy.cuda.Device().id, MAX_FUSED_DECODE_ROWS * config.linear_num_key_heads)



def start_up_kernels(config: Qwen35Config) -> list[tuple[str, int, int, bool]]:
    """``(name, key head dim, conv width, f16 operands)`` of every kernel ``config`` runs: the fused
    decode, the chosen prefill variant's, and those every variant shares (the rows' conv, norms)."""
    dk, width = config.linear_key_head_dim, config.linear_conv_kernel_dim
    found = [(name, dk, 0, False) for name in SOURCES["gated_deltanet.cu"]]
    if 2 <= width <= MAX_CONV_WIDTH:
        found.append(("gdn_conv1d_vec", dk, width, False))
    if chunked_supported(config):
        found += [(name, dk, 0, False) for name in ("gdn_chunk_prepare", *STAGED_PREPARE_KERNELS, "gdn_chunk_scan",
                                                     "gdn_chunk_states", "gdn_chunk_output", "gdn_chunk_output_norm")]
        if dk <= REGISTER_STATES_MAX_KEY_HEAD_DIM:
            found.append(("gdn_chunk_states_registers", dk, 0, False))
        chosen = prefill_kernels(config, 8)  # a row stride in eights: the in_proj widths that serve
        f16 = chosen.f16_operands
        found += [(walk, dk, 0, f16 and walk in F16_OPERAND_KERNELS)  # the walks storing snapshots
                  for walk in ("gdn_chunk_states" + SNAPSHOT_WALK_SUFFIX, "gdn_chunk_states_registers" + SNAPSHOT_WALK_SUFFIX)
                  if walk.startswith("gdn_chunk_states_snapshot") or dk <= REGISTER_STATES_MAX_KEY_HEAD_DIM]
        for name in (chosen.conv, chosen.norm, chosen.prepare, chosen.states, chosen.output):
            conv_width = width if name == CONV_PREPARE_KERNEL else 0
            found.append((name, dk, conv_width, f16 and name in F16_OPERAND_KERNELS))
        if chosen.prepare == FP32_PREPARE_KERNEL:  # their own sources
            found.append(("gdn_chunk_walk_fp32", dk, 0, False))
        if chosen.prepare in SPLIT_PREPARE_KERNELS and chosen.states not in SPLIT_WALK_KERNELS:
            found.append((SPLIT_WALK_KERNELS[0], dk, 0, False))
        twin = _snapshot_walk(chosen)  # a split chain's walk storing snapshots
        if twin is not None and chosen.prepare in SPLIT_PREPARE_KERNELS:
            found.append((twin, dk, 0, False))
    if fused_decode_supported(config):
        chosen_decode = decode_kernel(config)
        found += [(name, dk, width, False) for name in DECODE_KERNELS.values()
                  if name != DECODE_KERNELS["bulk"] or chosen_decode == name]  # bulk (opt-in): only when chosen
    return list(dict.fromkeys(found))


def start_builds(config: Qwen35Config) -> int:
    """Begin building ``config``'s kernels in background threads now, before the weights load (the
    core loader's one-kernel modules: NVRTC releases the GIL); ``warm_up`` waits for them. Returns
    how many builds started."""
    keys = [_kernel_key(*found) for found in start_up_kernels(config)]
    return loader.start_compiling(keys, cupy.cuda.Device().id)


def warm_up(config: Qwen35Config) -> None:
    """Compile the kernels this config runs (in parallel, or wait for ``start_builds``' builds) and
    allocate the decode counters — before any CUDA graph capture, which must neither compile nor
    allocate outside its pool. A kernel taking more than 48 KiB of dynamic shared memory opts in
    where ``kernel`` first makes its handle for a launch (a function attribute, no stream work:
    allowed inside a capture)."""
    loader.compile_kernels([_kernel_key(*found) for found in start_up_kernels(config)], cupy.cuda.Device().id)
    if fused_decode_supported(config):
        arrival_counters(config)


def _blocks(n: int, threads: int = 256, cap: int = 8192) -> int:
    return max(1, min(cap, (n + threads - 1) // threads))


def _bf16(x: Any, what: str) -> cupy.ndarray:
    if not isinstance(x, cupy.ndarray) or x.dtype != cupy.uint16:
        raise ValueError(f"{what} must be a bf16 (uint16) CuPy array, got {type(x).__name__} "
                         f"{getattr(x, 'dtype', '')}")
    return x


class PinnedUploads:
    """Small int32 host → device copies of a step's metadata, several arrays packed into one pinned
    staging buffer and sent by one asynchronous copy on the current stream (``cupy.asarray`` also
    stages through CuPy's pinned pool asynchronously, but one array a call: a prefill step's row map
    and ``fresh`` were an upload plus four elementwise kernels, a snapshot split would be ten
    uploads). Each staging buffer is kept until its copy's event has passed, then returned to
    CuPy's pinned pool."""

    def __init__(self) -> None:
        self._in_flight: collections.deque = collections.deque()  # (event, pinned memory) in copy order

    def upload(self, sections: list[np.ndarray]) -> list[cupy.ndarray]:
        """One copy of ``sections`` (flattened, as int32); their device views, in order."""
        while self._in_flight and self._in_flight[0][0].done:
            self._in_flight.popleft()
        sizes = [int(np.size(section)) for section in sections]
        total = max(1, sum(sizes))
        memory = cupy.cuda.alloc_pinned_memory(4 * total)
        staging = np.frombuffer(memory, np.int32, total)
        offset = 0
        for section, size in zip(sections, sizes, strict=True):
            staging[offset:offset + size] = np.asarray(section).reshape(-1)
            offset += size
        device = cupy.empty(total, dtype=cupy.int32)
        stream = cupy.cuda.get_current_stream()
        device.set(staging, stream=stream)
        copied = cupy.cuda.Event(block=False, disable_timing=True)
        copied.record(stream)
        self._in_flight.append((copied, memory))
        views, offset = [], 0
        for size in sizes:
            views.append(device[offset:offset + size])
            offset += size
        return views


_uploads = PinnedUploads()
# "1" (default) / "0": one cupy.asarray of the sections. By measurement (H200, D1 2026-11-24,
# gpu_qwen35.py --multi-turn-only, medians of 5, RESULTS/D1/warm17d): the warm 4k + 50 turn's
# forwards 21.6-22.5 + 17.1-18.3 -> 16.7-19.6 + 12.8-14.3 ms of host time, warm TTFT 46.4 -> 37.9 ms
PINNED_UPLOADS_ENV = "OPENINFER_QWEN35_PINNED_UPLOADS"


def upload_int32(*sections: np.ndarray) -> list[cupy.ndarray]:
    """``sections`` as int32 device arrays, in one asynchronous copy (``PinnedUploads``);
    ``OPENINFER_QWEN35_PINNED_UPLOADS=0``: one ``cupy.asarray`` of them concatenated (the A/B)."""
    if os.environ.get(PINNED_UPLOADS_ENV, "").strip() == "0":
        sizes = np.cumsum([0] + [int(np.size(section)) for section in sections])
        device = cupy.asarray(np.concatenate([np.asarray(x).reshape(-1) for x in sections]).astype(np.int32))
        return [device[sizes[i]:sizes[i + 1]] for i in range(len(sections))]
    return _uploads.upload(list(sections))


def _sequence_views(seqs: StepSequences) -> list[np.ndarray]:
    query_start = np.asarray(seqs.query_start, np.int64)
    token_seq = np.repeat(np.arange(len(seqs.slots)), np.diff(query_start))
    return [query_start, np.asarray(seqs.slots), np.asarray(seqs.fresh), token_seq]


def _with_views(seqs: StepSequences, views: list[cupy.ndarray]) -> StepSequences:
    device = dict(zip(("query_start", "slots", "fresh", "token_seq"), views, strict=True))
    return StepSequences(seqs.query_start, seqs.slots, seqs.fresh, device=device, snapshots=seqs.snapshots)


def prepare_sequences(seqs: StepSequences) -> StepSequences:
    """Device int32 copies of the step's sequence arrays (one small asynchronous upload)."""
    return _with_views(seqs, upload_int32(*_sequence_views(seqs)))


def copy_state_rows(tensors: list[cupy.ndarray], pairs: tuple[tuple[int, int], ...]) -> None:
    """``tensor[dst] = tensor[src]`` for each (src, dst) of ``pairs``, in every tensor (state slots:
    contiguous rows), by one device-to-device copy each on the current stream: no kernel, a few
    microseconds of the host where an indexed assignment costs a launch and its checks."""
    stream = cupy.cuda.get_current_stream()
    for tensor in tensors:
        if not tensor.flags.c_contiguous:
            for src, dst in pairs:
                tensor[dst] = tensor[src]
            continue
        row = tensor.nbytes // tensor.shape[0]
        for src, dst in pairs:
            (tensor.data + dst * row).copy_from_device_async(tensor.data + src * row, row, stream)


def prepare_split(split: SnapshotSplit) -> SnapshotSplit:
    """A step's ``SnapshotSplit`` with its sequences, row order and slot pairs on the device (one
    upload a step; the model's layers share it)."""
    orders = [] if split.order is None else [split.order, split.inverse]
    views = upload_int32(*_sequence_views(split.head), *_sequence_views(split.tail), split.live, split.snapshot,
                         *orders)
    order, inverse = (None, None) if split.order is None else (views[10], views[11])
    return SnapshotSplit(_with_views(split.head, views[0:4]), _with_views(split.tail, views[4:8]), split.num_head_rows,
                         order, inverse, views[8], views[9], split.pairs)


SNAPSHOT_EMIT_ENV = "OPENINFER_QWEN35_SNAPSHOT_EMIT"  # "1" / "0": the state walk writes in-step snapshots / a split
SNAPSHOT_WALK_SUFFIX = "_snapshot"  # gdn_chunk_states{,_registers}_snapshot: the walks that store a boundary's state
# on by measurement (H200, D2 2026-11-24 session 12, main 9686efb, one lease, gpu_concurrency.py bursts of 1,000-token
# prompts: every prompt snapshots at 992 inside its step; RESULTS/D2/snap17): out tok/s 16 / 64 streams 2,553 / 4,239
# (split run) -> 2,665 / 4,569 (+4.4 / +7.8 %; TTFT p50 at 64: 624 -> 542 ms); a tail step instead
# (SNAPSHOT_IN_STEP=0) 2,641 / 4,536. Outputs and snapshot states bit-identical to the split run
# (test_qwen35_warm_turn_gpu.py). "0": each GDN layer in two parts around the boundary again
DEFAULT_SNAPSHOT_EMIT = True


def snapshot_emit() -> bool:
    """``OPENINFER_QWEN35_SNAPSHOT_EMIT`` (read each step), else ``DEFAULT_SNAPSHOT_EMIT``."""
    value = os.environ.get(SNAPSHOT_EMIT_ENV, "").strip().lower()
    if value not in ("", "0", "1"):
        raise ValueError(f"{SNAPSHOT_EMIT_ENV}={value!r}: expected '1' or '0'")
    return DEFAULT_SNAPSHOT_EMIT if not value else value == "1"


def writes_snapshots(seqs: StepSequences, config: Qwen35Config) -> bool:
    """Whether ``delta_net`` writes this step's in-step snapshots (``seqs.snapshots``) itself, in
    the layer's one run: the chunked path with a state walk that stores the state at a boundary
    (``gdn_chunk_states{,_registers}_snapshot``: the chunk layout cut there, the fp32 S entering
    that chunk into the snapshot slot) and ``gdn_conv_snapshot`` for the conv window. Otherwise
    (switched off, the token-by-token path, a prefill variant whose walk does not store it: the
    plain scan, chunked_fp32, chunked_split's bf16 walk) the model runs each GDN layer in two parts
    around the boundary (``state.split_at_snapshots``); the split-operand chains with fp16 parts
    (chunked_split_f16 and its walk variants) store it. A variant can emit once its walk takes the two
    arrays of the *_snapshot walks (``snapshot_chunk``, ``snapshot_slot``: see gdn_chunked.cu)."""
    if seqs.snapshots is None or seqs.query_start is None or not snapshot_emit():
        return False
    if use_recurrent_kernels() or not chunked_supported(config):
        return False
    if int(np.diff(np.asarray(seqs.query_start)).max()) < CHUNKED_MIN_TOKENS:
        return False  # the token-by-token path
    nv = config.linear_num_value_heads
    return _walk_stores_snapshots(prefill_kernels(config, config.conv_dim + config.linear_value_dim + 2 * nv))


def _walk_stores_snapshots(prefill: PrefillKernels) -> bool:
    """Whether ``prefill``'s chunk walk has a *_snapshot entry point (``_snapshot_walk``)."""
    return _snapshot_walk(prefill) is not None


def _snapshot_walk(prefill: PrefillKernels) -> str | None:
    """The *_snapshot twin of ``prefill``'s chunk walk (in SOURCES), or None: the split scan's walks
    (gdn_chunk_states{,_registers}: either may run, both have one) and the split-operand chains'
    walks that have one (gdn_chunked_split.cu's fp16-part walks; the bf16 gdn_chunk_walk_split has
    none); the fp32 chain and the plain scan have none."""
    if prefill.prepare in SPLIT_PREPARE_KERNELS:
        walk = prefill.states if prefill.states in SPLIT_WALK_KERNELS else SPLIT_WALK_KERNELS[0]
    elif prefill.split_scan and prefill.prepare != FP32_PREPARE_KERNEL:
        walk = prefill.states
    else:
        return None
    twin = walk + SNAPSHOT_WALK_SUFFIX
    return twin if twin in SOURCE_OF else None


def _snapshot_walk_arrays(seqs: StepSequences, walk_seq_ids: np.ndarray | None,
                          seq_chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per sequence of the walk (``walk_seq_ids``: the step's sequence of each; None: all): the chunk
    entering which the walk stores the state (-1 none) and the snapshot slot (0 none)."""
    num = len(seq_chunks) - 1
    chunk, slot = np.full(num, -1, np.int64), np.zeros(num, np.int64)
    position = (np.arange(num) if walk_seq_ids is None
                else np.full(len(seqs.slots), -1, np.int64))
    if walk_seq_ids is not None:
        position[np.asarray(walk_seq_ids, np.int64)] = np.arange(num)
    for seq, cut, snapshot in np.asarray(seqs.snapshots, np.int64).reshape(-1, 3):
        k = int(position[seq])
        if k < 0:
            raise ValueError(f"a state snapshot in sequence {seq}, which the chunked walk does not run")
        chunk[k] = int(seq_chunks[k]) + -(-int(cut) // CHUNK_SIZE)
        slot[k] = snapshot
    return chunk, slot


def _snapshot_cuts(seqs: StepSequences, walk_seq_ids: np.ndarray | None) -> np.ndarray:
    """Per sequence of the walk: rows before its snapshot's boundary (0: none), for ``chunk_layout``."""
    ids = np.arange(len(seqs.slots)) if walk_seq_ids is None else np.asarray(walk_seq_ids, np.int64)
    cut_of = np.zeros(len(seqs.slots), np.int64)
    snapshots = np.asarray(seqs.snapshots, np.int64).reshape(-1, 3)
    cut_of[snapshots[:, 0]] = snapshots[:, 1]
    return cut_of[ids]


def device_sequences(batch: Any) -> StepSequences:
    """The step's sequences straight from a ``CudaBatch``'s device arrays: slots from
    ``batch.state_slots``, ``fresh`` where the context starts with this step (or is empty: a
    CUDA-graph padding row, which then reads zeros and writes the null slot). Decode steps
    touch no host memory, so they can be captured in a CUDA graph; prefill steps upload the
    row → sequence map and ``fresh`` from the host batch (one asynchronous copy) and keep the
    host ``query_start``."""
    if batch.state_slots is None:
        raise ValueError("Qwen3.5 keeps recurrent state: the device batch carries no state_slots "
                         "(the engine fills them from the model's RecurrentStateSpec)")
    num_seqs = batch.num_seqs
    query_start = batch.query_start
    if batch.num_tokens == num_seqs:  # one token per sequence (decode, graph replay)
        fresh = ((batch.context_lens - (query_start[1:] - query_start[:-1])) <= 0).astype(cupy.int32)
        views = {"query_start": query_start, "slots": batch.state_slots, "fresh": fresh,
                 "token_seq": cupy.arange(num_seqs, dtype=cupy.int32)}
        return StepSequences(None, batch.state_slots, fresh, device=views)
    # prefill: the host row map also lays out the chunks of the chunked kernels; slots and fresh
    # on the host too (a snapshot split is planned from them), on the device in the views
    host_batch = batch.host
    host = np.asarray(host_batch.query_start, np.int32)
    host_fresh = (np.asarray(host_batch.context_lens) - np.diff(host)) <= 0
    token_seq, fresh = upload_int32(np.repeat(np.arange(num_seqs, dtype=np.int32), np.diff(host)), host_fresh)
    views = {"query_start": query_start, "slots": batch.state_slots, "fresh": fresh, "token_seq": token_seq}
    return StepSequences(host, np.asarray(host_batch.state_slots), host_fresh, device=views,
                         snapshots=step_snapshots(batch))


def delta_net(proj: cupy.ndarray, w: DeltaNetWeights, conv_state: cupy.ndarray, ssm_state: cupy.ndarray,
              seqs: StepSequences, config: Qwen35Config, out: cupy.ndarray | None = None) -> cupy.ndarray:
    """``[T, q|k|v|z|b|a]`` bf16 → gated-normed ``[T, nv·dv]`` bf16; updates the slots in place.
    ``out``: a contiguous ``[T, nv·dv]`` bf16 array to write (rows of a larger one: the snapshot split's)."""
    proj = cupy.ascontiguousarray(_bf16(proj, "delta_net projection"))
    conv_dim, value_dim = config.conv_dim, config.linear_value_dim
    nk, nv, dk, dv = (config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
                      config.linear_value_head_dim)
    width = config.linear_conv_kernel_dim
    if proj.shape[1] != conv_dim + value_dim + 2 * nv:
        raise ValueError(f"delta_net projection has {proj.shape[1]} features, expected "
                         f"{conv_dim + value_dim + 2 * nv} (q|k|v|z|b|a)")
    if not 2 <= width <= MAX_CONV_WIDTH or dk > MAX_KEY_HEAD_DIM or dk % SPLIT:
        raise ValueError(f"cuda Gated DeltaNet supports conv width 2..{MAX_CONV_WIDTH} and key head dims <= "
                         f"{MAX_KEY_HEAD_DIM} divisible by {SPLIT}; got {width} and {dk}")
    if ssm_state.dtype != cupy.float32 or conv_state.dtype != cupy.uint16:
        raise ValueError("state slots must be fp32 (ssm) and bf16 (conv) CuPy arrays")
    device = seqs.device
    num_tokens, num_seqs = proj.shape[0], len(seqs.slots)
    stride = np.int32(proj.shape[1])
    if out is None:
        out = cupy.empty((num_tokens, value_dim), dtype=cupy.uint16)
    elif out.shape != (num_tokens, value_dim) or out.dtype != cupy.uint16 or not out.flags.c_contiguous:
        raise ValueError(f"delta_net out must be a contiguous bf16 [{num_tokens}, {value_dim}] array, got "
                         f"{out.dtype} {tuple(out.shape)}")
    if num_tokens == 0:
        return out
    recurrent = use_recurrent_kernels()
    if (num_tokens == num_seqs and not recurrent and fused_decode_supported(config)
            and num_seqs <= MAX_FUSED_DECODE_ROWS):
        args = (proj, stride, w.conv_weight, conv_state, ssm_state, w.neg_decay_rate, w.dt_bias, w.norm,
                device["query_start"], device["slots"], device["fresh"], arrival_counters(config), out, np.int32(nk),
                np.int32(nv), np.int32(dv), np.int32(width), np.float32(config.rms_norm_eps))
        name = decode_kernel(config)
        if name in (DECODE_KERNELS["vec4"], DECODE_KERNELS["bulk"]) and not _aligned(ssm_state):  # 16-byte accesses
            name = DECODE_KERNELS["coalesced"]
        function, shared = _decode_function(name, config)
        _launch(name, function, (num_seqs, nv), (fused_decode_threads(config),), args, shared_mem=shared)
        return out
    conv_out = cupy.empty((num_tokens, conv_dim), dtype=cupy.uint16)
    core = cupy.empty((num_tokens, value_dim), dtype=cupy.uint16)  # delta-rule output, before the norm
    prefill = prefill_kernels(config, proj.shape[1])
    if prefill.conv == "gdn_conv1d_vec" and not _aligned(proj, conv_state, w.conv_weight):
        prefill = prefill._replace(conv=PREFILL_KERNELS["plain"].conv)  # its 16-byte loads need aligned rows
    host_query_start = seqs.query_start
    chunked_step = (not recurrent and host_query_start is not None and chunked_supported(config)
                    and int(np.diff(host_query_start).max()) >= CHUNKED_MIN_TOKENS)
    if prefill.prepare == CONV_PREPARE_KERNEL and (not chunked_step or prefill.conv != "gdn_conv1d_vec"):
        prefill = prefill._replace(prepare=PREFILL_KERNELS["grouped_mma"].prepare)  # the conv's 16-byte loads
    conv_args = (proj, stride, w.conv_weight, conv_state, device["query_start"], device["slots"], device["fresh"],
                 device["token_seq"], conv_out)
    lengths = np.diff(host_query_start) if chunked_step else None
    single, chunked, ids = (_one_token_rows(seqs) if chunked_step and prefill.rows_apart
                            else (np.zeros(0, np.int64), None, None))

    def update_conv_windows() -> None:
        _launch("gdn_conv_state", kernel("gdn_conv_state", dk),
                (_blocks(num_seqs * conv_dim),), (256,),
                (proj, stride, conv_state, device["query_start"], device["slots"], device["fresh"], np.int32(num_seqs),
                 np.int32(conv_dim), np.int32(width)))

    snapshots = seqs.snapshots  # in-step snapshots written in this one run (``writes_snapshots``)
    if snapshots is not None:
        if not (chunked_step and _walk_stores_snapshots(prefill)):
            raise ValueError("delta_net got state snapshots inside the step but its kernels cannot write them "
                             "(writes_snapshots is False): split the step (state.split_at_snapshots)")
        rows = _step_cached(seqs, "qwen35_snapshot_rows", lambda: upload_int32(snapshots)[0])
        # the conv windows at the boundaries, read before gdn_conv_state rewrites the live ones
        _launch("gdn_conv_snapshot", kernel("gdn_conv_snapshot", dk), (_blocks(len(snapshots) * conv_dim),), (256,),
                (proj, stride, conv_state, device["query_start"], device["slots"], device["fresh"], rows,
                 np.int32(len(snapshots)), np.int32(conv_dim), np.int32(width)))

    conv_in_prepare = prefill.prepare == CONV_PREPARE_KERNEL
    if conv_in_prepare:  # only the one-token rows here; the prepare convolves the chunked rows
        if len(single):
            _launch("gdn_conv1d_vec_rows", kernel("gdn_conv1d_vec_rows", dk, 0, width),
                    (-(-len(single) // CONV_TOKENS), -(-conv_dim // 1024)), (128,),
                    (*conv_args, np.int32(len(single)), np.int32(conv_dim), np.int32(width), ids[len(lengths) :]))
    else:
        if prefill.conv == "gdn_conv1d_vec":  # the conv width compiled in; CONV_TOKENS tokens a thread
            conv_kernel = kernel(prefill.conv, dk, 0, width)
            conv_grid, conv_block = (-(-num_tokens // CONV_TOKENS), -(-conv_dim // 1024)), (128,)
        else:
            conv_kernel, conv_grid, conv_block = kernel(prefill.conv, dk), (_blocks(num_tokens * conv_dim),), (256,)
        _launch(prefill.conv, conv_kernel, conv_grid, conv_block,
                (*conv_args, np.int32(num_tokens), np.int32(conv_dim), np.int32(width)))
        update_conv_windows()
    tile_dv = min(dv, TILE_DV)
    delta_rule_grid, delta_rule_block = (nv, -(-dv // tile_dv)), (-(-tile_dv * SPLIT // 32) * 32,)
    delta_rule_args = (proj, stride, conv_out, ssm_state, w.neg_decay_rate, w.dt_bias, device["query_start"],
                       device["slots"], device["fresh"], core, np.int32(nk), np.int32(nv), np.int32(dv),
                       np.int32(tile_dv))
    norm_args = (proj, stride, w.norm, out, np.int32(conv_dim), np.int32(value_dim), np.int32(nv), np.int32(dv),
                 np.float32(config.rms_norm_eps))
    if chunked_step:
        fused_norm = prefill.output == "gdn_chunk_output_norm"
        chunk_out = out if fused_norm else core  # the output kernel norms the chunked rows itself
        # the fused conv reads the old windows: gdn_conv_state runs after the prepare
        conv = (conv_state, width, update_conv_windows) if conv_in_prepare else None
        if len(single):
            _launch("gdn_delta_rule_rows", kernel("gdn_delta_rule_rows", dk), (len(single), *delta_rule_grid),
                    delta_rule_block, (*delta_rule_args, ids[: len(single)]))
            _chunked_delta_rule(proj, conv_out, w, ssm_state, seqs, config, chunk_out, prefill,
                                (chunked, ids[len(single) : len(lengths)]), conv)
            if fused_norm:  # the one-token rows' norm
                _launch("gdn_gated_norm_rows", kernel("gdn_gated_norm_rows", dk), (len(single), -(-nv // 4)), (128,),
                        (core, *norm_args, ids[len(lengths) :]))
                return out
        else:
            _chunked_delta_rule(proj, conv_out, w, ssm_state, seqs, config, chunk_out, prefill, conv=conv)
            if fused_norm:
                return out
    else:
        _launch("gdn_delta_rule", kernel("gdn_delta_rule", dk), (num_seqs, *delta_rule_grid), delta_rule_block,
                delta_rule_args)
    if prefill.norm == "gdn_gated_norm_vec" and not _aligned(core, proj, out, w.norm):
        prefill = prefill._replace(norm="gdn_gated_norm_warp")  # its 16-byte accesses need aligned rows
    if prefill.norm == "gdn_gated_norm_vec":
        _launch(prefill.norm, kernel(prefill.norm, dk), (num_tokens, -(-(nv * dv // 8) // 128)), (128,),
                (core, *norm_args))
    elif prefill.norm == "gdn_gated_norm_warp":
        _launch(prefill.norm, kernel(prefill.norm, dk), (num_tokens, -(-nv // 4)), (128,), (core, *norm_args))
    else:
        _launch("gdn_gated_norm", kernel("gdn_gated_norm", dk),
                (num_tokens, nv), (min(256, -(-dv // 32) * 32),),
                (core, proj, stride, w.norm, out, np.int32(conv_dim), np.int32(value_dim), np.int32(dv),
                 np.float32(config.rms_norm_eps)))
    return out


def _step_cached(seqs: StepSequences, key: str, make: Any) -> Any:
    """``make()`` once per step: kept in the step's ``seqs.device`` dict (built per step, shared by
    its layers), so the chunk layout and row ids are computed and uploaded once a step, not once
    a layer (24 host → device copies from pageable memory fewer a mixed step of the 4B shape)."""
    cache = seqs.device
    if key not in cache:
        cache[key] = make()
    return cache[key]


def _one_token_rows(seqs: StepSequences) -> tuple[np.ndarray, np.ndarray | None, cupy.ndarray | None]:
    """A chunked step's one-token rows (host sequence ids), its other sequences, and one device array
    of the one-token rows' sequences, the chunked sequences and the one-token rows' token rows (or
    empty, None, None when there are no one-token rows)."""

    def make():
        lengths = np.diff(seqs.query_start)
        single = np.flatnonzero(lengths == 1)
        if not len(single):
            return single, None, None
        chunked = np.flatnonzero(lengths > 1)
        (ids,) = upload_int32(np.concatenate([single, chunked, seqs.query_start[single]]))
        return single, chunked, ids

    return _step_cached(seqs, "qwen35_one_token_rows", make)


def _chunked_delta_rule(proj: cupy.ndarray, conv_out: cupy.ndarray, w: DeltaNetWeights, ssm_state: cupy.ndarray,
                        seqs: StepSequences, config: Qwen35Config, core: cupy.ndarray, prefill: PrefillKernels,
                        subset: tuple[np.ndarray, cupy.ndarray] | None = None,
                        conv: tuple[cupy.ndarray, int, Any] | None = None) -> None:
    """The delta rule of a prefill step on tensor cores (gdn_chunked.cu): every sequence (or the
    ``subset``'s: host and device sequence ids) cut into chunks of 64 from its first row;
    ``core`` gets the output O (the layer's gated-normed output when ``prefill.output`` norms it),
    the slots the new state. ``conv`` (the conv state slots, the conv width and a launch of
    gdn_conv_state) when ``prefill.prepare`` convolves the rows itself: the windows are updated
    right after it. ``seqs.snapshots`` (in-step snapshots, ``writes_snapshots``): the layout cut at
    each boundary and the state walk's *_snapshot entry point stores the state there."""
    nk, nv, dk, dv = (config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
                      config.linear_value_head_dim)
    num_tokens = proj.shape[0]
    slots, fresh = seqs.device["slots"], seqs.device["fresh"]
    if subset is None:
        num_seqs = len(seqs.slots)
    else:
        host_ids, device_ids = subset
        num_seqs = len(host_ids)
        slots, fresh = slots[device_ids], fresh[device_ids]

    snapshots, walk_ids = seqs.snapshots, None if subset is None else subset[0]

    def make_layout() -> tuple[int, cupy.ndarray]:
        cuts = None if snapshots is None else _snapshot_cuts(seqs, walk_ids)
        chunk_start, chunk_len, seq_chunks = chunk_layout(seqs.query_start, seq_ids=walk_ids, cuts=cuts)
        sections = [chunk_start, chunk_len, seq_chunks]
        if snapshots is not None:  # each walk sequence's snapshot chunk (-1 none) and slot
            sections += _snapshot_walk_arrays(seqs, walk_ids, seq_chunks)
        return len(chunk_start), upload_int32(np.concatenate(sections))[0]

    # the same every layer of the step (the subset is always the step's chunked sequences)
    num_chunks, layout = _step_cached(seqs, "qwen35_chunk_layout" + ("" if subset is None else "_subset"), make_layout)
    starts, lengths = layout[:num_chunks], layout[num_chunks : 2 * num_chunks]
    per_seq = layout[2 * num_chunks : 2 * num_chunks + num_seqs + 1]
    snapshot_args = () if snapshots is None else (layout[2 * num_chunks + num_seqs + 1 : 2 * num_chunks + 2 * num_seqs + 1],
                                                  layout[2 * num_chunks + 2 * num_seqs + 1 :])
    if snapshots is not None and not _walk_stores_snapshots(prefill):
        raise ValueError(f"the {prefill.prepare} chain's walk does not store in-step snapshots")
    if prefill.prepare in SPLIT_PREPARE_KERNELS:  # the split-operand chain: its prepare and walk, fp32 arrays
        walk = prefill.states if prefill.states in SPLIT_WALK_KERNELS else SPLIT_WALK_KERNELS[0]
        prepare_bytes, walk_bytes = chunked_split_shared_bytes(dk, dv, walk)
        norms = cupy.empty((num_tokens, nk, 2), dtype=cupy.float32)
        # (the fp16-part prepare stores W and P pre-split: each float pair's 8 bytes hold its fp16 hi / lo pairs)
        w32, u32 = cupy.empty((num_tokens, nv, dk), dtype=cupy.float32), cupy.empty((num_tokens, nv, dv), cupy.float32)
        p32 = cupy.empty((num_chunks, nv, CHUNK_SIZE, CHUNK_SIZE), dtype=cupy.float32)
        cum32 = cupy.empty((num_tokens, nv), dtype=cupy.float32)
        _launch(prefill.prepare, kernel(prefill.prepare, dk, prepare_bytes), (num_chunks, nv),
                (SPLIT_THREADS,), (conv_out, proj, np.int32(proj.shape[1]), w.neg_decay_rate, w.dt_bias, starts,
                                   lengths, norms, w32, u32, p32, cum32, np.int32(nk), np.int32(nv), np.int32(dv)),
                shared_mem=prepare_bytes)
        walk_name = walk + (SNAPSHOT_WALK_SUFFIX if snapshot_args else "")  # its twin stores in-step snapshots
        _launch(walk_name, kernel(walk_name, dk, walk_bytes),
                (dv // SPLIT_WALK_TILE, num_seqs, nv), (SPLIT_THREADS,),
                (conv_out, norms, w32, u32, p32, cum32, starts, lengths, per_seq, slots, fresh, ssm_state, core,
                 np.int32(nk), np.int32(nv), np.int32(dv), *snapshot_args), shared_mem=walk_bytes)
        return
    if prefill.prepare == FP32_PREPARE_KERNEL:  # the fp32 chain: its prepare and walk, every array fp32
        prepare_bytes, walk_bytes = chunked_fp32_shared_bytes(dk, dv)
        qn32, kn32 = (cupy.empty((num_tokens, nk, dk), dtype=cupy.float32) for _ in range(2))
        w32, u32 = cupy.empty((num_tokens, nv, dk), dtype=cupy.float32), cupy.empty((num_tokens, nv, dv), cupy.float32)
        p32 = cupy.empty((num_chunks, nv, CHUNK_SIZE, CHUNK_SIZE), dtype=cupy.float32)
        cum32 = cupy.empty((num_tokens, nv), dtype=cupy.float32)
        _launch(FP32_PREPARE_KERNEL, kernel(FP32_PREPARE_KERNEL, dk, prepare_bytes), (num_chunks, nv), (FP32_THREADS,),
                (conv_out, proj, np.int32(proj.shape[1]), w.neg_decay_rate, w.dt_bias, starts, lengths, qn32, kn32, w32,
                 u32, p32, cum32, np.int32(nk), np.int32(nv), np.int32(dv)), shared_mem=prepare_bytes)
        _launch("gdn_chunk_walk_fp32", kernel("gdn_chunk_walk_fp32", dk, walk_bytes),
                (num_seqs, nv, dv // FP32_WALK_TILE), (FP32_THREADS,),
                (qn32, kn32, w32, u32, p32, cum32, starts, lengths, per_seq, slots, fresh, ssm_state, core, np.int32(nk),
                 np.int32(nv), np.int32(dv)), shared_mem=walk_bytes)
        return
    qn = cupy.empty((num_tokens, nk, dk), dtype=cupy.uint16)
    kn = cupy.empty((num_tokens, nk, dk), dtype=cupy.uint16)
    w_chunks = cupy.empty((num_tokens, nv, dk), dtype=cupy.uint16)
    u_chunks = cupy.empty((num_tokens, nv, dv), dtype=cupy.uint16)
    p_chunks = cupy.empty((num_chunks, nv, CHUNK_SIZE, CHUNK_SIZE), dtype=cupy.uint16)
    cum = cupy.empty((num_tokens, nv), dtype=cupy.float32)
    prepare = prefill.prepare
    if prefill.f16_operands and not (prefill.split_scan and {prepare, prefill.output} <= F16_OPERAND_KERNELS):
        prefill = prefill._replace(f16_operands=False)  # a fallback kernel of the chain takes bf16 operands
    f16 = prefill.f16_operands
    if prepare in GROUPED_PREPARE_KERNELS:  # a block per chunk and key head (or per value head: small steps)
        prepare_bytes = chunk_prepare_grouped_shared_bytes(dk, dv, nv // nk)
        prepare_grid = (num_chunks, nk, grouped_prepare_split(num_chunks, nk, nv // nk))
    else:
        prepare_bytes = chunk_prepare_shared_bytes(dk, dv, prepare in STAGED_PREPARE_KERNELS)
        prepare_grid = (num_chunks, nv)
    outputs = (starts, lengths, qn, kn, w_chunks, u_chunks, p_chunks, cum, np.int32(nk), np.int32(nv), np.int32(dv))
    if prepare == CONV_PREPARE_KERNEL:
        conv_state, width, update_conv_windows = conv
        device = seqs.device
        _launch(prepare, kernel(prepare, dk, prepare_bytes, width), prepare_grid, (128,),
                (proj, np.int32(proj.shape[1]), w.conv_weight, conv_state, device["query_start"], device["slots"],
                 device["fresh"], device["token_seq"], np.int32(width), w.neg_decay_rate, w.dt_bias, *outputs),
                shared_mem=prepare_bytes)
        update_conv_windows()
    else:
        _launch(prepare, kernel(prepare, dk, prepare_bytes, f16_operands=f16), prepare_grid, (128,),
                (conv_out, proj, np.int32(proj.shape[1]), w.neg_decay_rate, w.dt_bias, *outputs),
                shared_mem=prepare_bytes)
    if prefill.split_scan:  # (`core` is the layer's output when prefill.output norms it)
        states = cupy.empty((num_chunks, nv, dv, dk), dtype=cupy.uint16)  # S^T entering each chunk
        v_new = cupy.empty((num_tokens, nv, dv), dtype=cupy.uint16)
        output_bytes = (chunk_output_staged_shared_bytes(dk, dv) if prefill.output == "gdn_chunk_output_staged"
                        else chunk_output_shared_bytes(dk))
        if prefill.states == "gdn_chunk_states_registers" and not register_walk_fills_gpu(dv, num_seqs * nv):
            prefill = prefill._replace(states=PrefillKernels._field_defaults["states"])
        states_name = prefill.states + (SNAPSHOT_WALK_SUFFIX if snapshot_args else "")
        if prefill.states == "gdn_chunk_states_registers":
            warps = register_states_warps(dv)
            states_bytes = chunk_states_registers_shared_bytes(dk, dv)
            states_kernel = kernel(states_name, dk, states_bytes, f16_operands=f16)
            states_grid, states_block = (num_seqs, nv, dv // (16 * warps)), (32 * warps,)
        else:
            states_bytes = chunk_states_shared_bytes(dk)
            states_kernel = kernel(states_name, dk, states_bytes, f16_operands=f16)
            states_grid, states_block = (num_seqs, nv, dv // SCAN_TILE), (128,)
        _launch(states_name, states_kernel, states_grid, states_block,
                (kn, w_chunks, u_chunks, cum, starts, lengths, per_seq, slots, fresh, ssm_state, states, v_new,
                 np.int32(nk), np.int32(nv), np.int32(dv), *snapshot_args), shared_mem=states_bytes)
        output_args = (qn, p_chunks, cum, states, v_new, starts, lengths, core, np.int32(nk), np.int32(nv),
                       np.int32(dv))
        if prefill.output == "gdn_chunk_output_norm":
            output_args += (proj, np.int32(proj.shape[1]), np.int32(config.conv_dim), w.norm,
                            np.float32(config.rms_norm_eps))
        _launch(prefill.output, kernel(prefill.output, dk, output_bytes, f16_operands=f16), (num_chunks, nv), (128,),
                output_args,
                shared_mem=output_bytes)
        return
    scan_bytes = chunk_scan_shared_bytes(dk)
    _launch("gdn_chunk_scan", kernel("gdn_chunk_scan", dk, scan_bytes),
            (num_seqs, nv, dv // SCAN_TILE), (128,),
            (qn, kn, w_chunks, u_chunks, p_chunks, cum, starts, lengths, per_seq, slots, fresh, ssm_state, core,
             np.int32(nk), np.int32(nv), np.int32(dv)), shared_mem=scan_bytes)


# vec by measurement (H200, E3 2026-11-24, main e0c0aad, 4,096 features): at 8,192 rows add_rms_norm
# 145.2 -> 68.2 us, sigmoid_mul 142.8 -> 53.0 us; 64 / 1,024 rows no slower (host-bound launches);
# sigmoid_mul the same bits, add_rms_norm within a bf16 rounding (tests/gpu/test_qwen35_kernels.py).
# OPENINFER_QWEN35_ROW_KERNELS=plain reverts.
DEFAULT_ROW_KERNELS = "vec"


def vec_row_kernels() -> bool:
    """``OPENINFER_QWEN35_ROW_KERNELS=vec`` (the default, ``DEFAULT_ROW_KERNELS``): sigmoid_mul_vec
    and zero_centred_add_rms_norm_vec (8 features a thread, 16-byte loads) where the shapes allow;
    ``plain``: the 2-byte kernels. Read at each launch (a graph keeps what it captured)."""
    choice = os.environ.get(ROW_KERNELS_ENV, "").strip().lower() or DEFAULT_ROW_KERNELS
    if choice not in ("plain", "vec"):
        raise ValueError(f"{ROW_KERNELS_ENV}={choice!r}: expected 'plain' or 'vec'")
    return choice == "vec"


def _aligned(*arrays: cupy.ndarray) -> bool:
    return all(a.data.ptr % 16 == 0 for a in arrays)


def sigmoid_mul(x: cupy.ndarray, gate: cupy.ndarray) -> cupy.ndarray:
    """``x · sigmoid(gate)``; ``gate`` may be a column slice of a wider array (row stride kept)."""
    x = cupy.ascontiguousarray(_bf16(x, "sigmoid_mul input"))
    gate = _bf16(gate, "sigmoid_mul gate")
    if gate.shape != x.shape or gate.strides[1] != 2:
        raise ValueError(f"sigmoid_mul: gate {tuple(gate.shape)} (strides {gate.strides}) must match x "
                         f"{tuple(x.shape)} with contiguous rows")
    out = cupy.empty_like(x)
    stride = gate.strides[0] // 2
    if x.size and vec_row_kernels() and x.shape[1] % 8 == 0 and stride % 8 == 0 and _aligned(x, gate, out):
        kernel("sigmoid_mul_vec")((_blocks(x.size // 8),), (256,),
                                  (x, gate, np.int32(stride), out, np.int64(x.shape[0]), np.int32(x.shape[1])))
    elif x.size:
        kernel("sigmoid_mul")((_blocks(x.size),), (256,),
                              (x, gate, np.int32(stride), out, np.int64(x.shape[0]), np.int32(x.shape[1])))
    return out


def rms_norm(x: cupy.ndarray, weight: cupy.ndarray, eps: float) -> cupy.ndarray:
    """Zero-centred RMSNorm with the fp32 weight ``1 + w``."""
    x = cupy.ascontiguousarray(_bf16(x, "rms_norm input"))
    out = cupy.empty_like(x)
    features = x.shape[-1]
    if x.size:
        kernel("zero_centred_rms_norm")((x.size // features,), (min(1024, -(-features // 32) * 32),),
                                        (x, weight, out, np.int32(features), np.float32(eps)))
    return out


def add_rms_norm(x: cupy.ndarray, residual: cupy.ndarray, weight: cupy.ndarray,
                 eps: float) -> tuple[cupy.ndarray, cupy.ndarray]:
    """``residual + x`` (bf16) and its zero-centred RMSNorm with the fp32 weight ``1 + w``."""
    x = cupy.ascontiguousarray(_bf16(x, "add_rms_norm input"))
    residual = cupy.ascontiguousarray(_bf16(residual, "add_rms_norm residual"))
    if x.shape != residual.shape:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    out, summed = cupy.empty_like(x), cupy.empty_like(x)
    features = x.shape[-1]
    threads = features // 8
    if (x.size and vec_row_kernels() and features % 8 == 0 and threads % 32 == 0 and threads <= 1024
            and _aligned(x, residual, weight, out, summed)):
        kernel("zero_centred_add_rms_norm_vec")((x.size // features,), (threads,),
                                                (x, residual, weight, out, summed, np.int32(features),
                                                 np.float32(eps)))
    elif x.size:
        kernel("zero_centred_add_rms_norm")((x.size // features,), (min(1024, -(-features // 32) * 32),),
                                            (x, residual, weight, out, summed, np.int32(features), np.float32(eps)))
    return out, summed


CUDA_PLAN = KernelPlan(
    backend="cuda",
    sigmoid_mul=sigmoid_mul,
    delta_net=delta_net,
    fp32_vector=functools.partial(upload_vector, dtype=np.float32),  # kept fp32: copied off the legacy stream
    conv_state_dtype="bfloat16",
    step_sequences=device_sequences,
    prepare_split=prepare_split,
    copy_state_rows=copy_state_rows,
    writes_snapshots=writes_snapshots,
    warm_up=warm_up, start_builds=start_builds,
    rms_norm=rms_norm,
    add_rms_norm=add_rms_norm,
    norm_weight=functools.partial(upload_vector, dtype=np.float32),
)
