"""Linear layers: weights kept as HF lays them out, ``[out_features, in_features]`` bf16 rows.

That one layout serves both GEMM paths: cuBLAS ``gemmEx`` (TN, row-major ``x @ W^T``) and our
skinny GEMM ``gemv.cu`` (one warp streams one weight row). Fused projections (qkv, gate_up) are
simply their row blocks stacked. Decode-sized inputs (at most ``GEMV_MAX_ROWS`` rows) take the
skinny kernel, which reads each weight byte once at close to copy bandwidth; the rest cuBLAS.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import cupy
import numpy as np

from openinfer.backend.cuda.cublas import Cublas
from openinfer.backend.cuda.loader import kernel
from openinfer.backend.cuda.row_buckets import padded_rows

GEMV_MAX_ROWS = 1  # measured on H200: gemv_m2..m8 lose to cuBLAS (bs 2-8 decode 4.3-10.7 ms vs 4.3)
GEMV_WARPS_PER_BLOCK = 8
GEMV_COLUMNS_PER_WARP = {1: 1, 2: 2, 4: 4, 8: 4}  # per kernel gemv_m{rows}, as in gemv.cu
# $OPENINFER_GEMV_M1_COLS (auto, 1, 2 or 4; unset: DEFAULT_GEMV_M1_COLS; another value: a clear error): the columns
# each warp of gemv_m1 owns (gemv.cu GEMV_M1_COLS: a grid that many times narrower, passes that many times shorter,
# the same loads in flight and the same bits). "auto": 2 where one column a warp takes more than a wave of resident
# blocks (GEMV_M1_BLOCKS_PER_SM an SM), else 1: a second, partial wave of blocks pays each block's ramp again, and a
# grid under a wave loses warps it needs in flight. s15 D4 (H200, Kimi-K2 layer b1 graph, alternated,
# results/kimi_layer_b1_s15d4_h200.json): 2 everywhere 169.1 / 169.8 vs 176.2 / 174.8 us with 1 (o_proj, 896 blocks
# -> 448: 33.5 -> 31.5 us alone; q_b, 1,536 -> 768: q_a_norm + q_b 18.0 -> 17.3) though qkv_a (264 -> 132 blocks)
# went 10.9 -> 12.7 and the shared gate_up (512 -> 256) 16.9 -> 17.5; 4 everywhere 181.7 / 180.3. D5 (the same,
# three alternations, kimi_layer_b1_s15d5_h200.json): auto 172.1 / 172.1 / 171.5, 1 173.5 / 172.7 / 172.0, 2 169.6 /
# 170.3 / 171.5 us (2 everywhere also thins the shared gate_up that runs beside the routing: the routing ends sooner).
# Alone (graphs of 16 calls on rotating copies, dense_gemv_cols_s15d5_h200.json; 1 -> 2 columns): Kimi-K2 q_b 12.2 ->
# 11.2, o_proj 29.2 -> 28.7, qkv_a 9.5 -> 11.4, shared gate_up 15.5 -> 16.3; Moonlight q+kv_a 5.6 -> 6.0, o_proj 4.1 ->
# 4.9, shared gate_up 7.9 -> 7.6, lm_head 146.1 -> 146.9; Qwen3-4B o_proj 7.2 -> 8.4, lm_head 170.0 -> 169.4 us: where
# "auto" picks 2 (more than a wave of blocks: q_b, o_proj, Moonlight's shared gate_up, the lm_heads) 2 wins or ties.
# (Each column's K split over 2 or 4 warps of a block, summed in split order through shared memory, GEMV_M1_KSPLIT, for
# one-row GEMVs whose one-column grid is under a wave: s16 D4, H200, Kimi-K2 layer b1 graph, alternated,
# results/kimi_layer_b1_s16d4_h200.json: "auto" (qkv_a split in 2) 168.7 / 168.5 / 167.3 / 167.8 us vs 168.8 / 168.2 /
# 167.4 / 169.6 without, qkv_a itself 9.4 -> 9.8 in the timeline; 4 everywhere 175.4-176.7. Deleted.)
GEMV_M1_COLS_ENV = "OPENINFER_GEMV_M1_COLS"
DEFAULT_GEMV_M1_COLS = "auto"
GEMV_M1_BLOCKS_PER_SM = 5  # gemv_m1 at 48 registers x 256 threads (sm_90a ptxas)
# $OPENINFER_GEMV_M1_COLS_BESIDE (1, 2 or 4; unset: DEFAULT_GEMV_M1_COLS_BESIDE): the fewest columns a warp of gemv_m1
# owns where it runs beside other work (``gemv_beside_other_work``: the shared experts on the MoE side stream, beside
# the routing and the routed experts), so that its narrower grid leaves SMs and bandwidth to the critical path. 2
# since s15 D6 (H200, Kimi-K2 layer b1 graph, three alternations, results/kimi_layer_b1_s15d6_h200.json): 168.8 /
# 167.7 / 169.1 us vs 172.2 / 172.2 / 174.9 with 1 (the shared gate_up, 512 blocks -> 256, beside moe_route_decode);
# 2 columns everywhere 170.8 / 170.4 / 172.0, 1 everywhere 174.7 / 173.5 / 173.1.
GEMV_M1_COLS_BESIDE_ENV = "OPENINFER_GEMV_M1_COLS_BESIDE"
DEFAULT_GEMV_M1_COLS_BESIDE = 2
_beside_other_work = threading.local()
NULL = np.uint64(0)
# "1": the o_proj and down GEMMs add their product into the residual stream in place (cuBLAS
# beta = 1), and the next norm is a plain rms_norm of it instead of add_rms_norm(x, residual): the
# GEMM writes no separate output and the norm reads one array instead of two (at 8k tokens, 2560
# features: 42 MB less traffic per call, 72 calls a step). The sum is rounded to bf16 once instead
# of twice (product, then sum), so the bits differ from the default's. Opt-in: E1 s8 (H200,
# benchmarks/results/mixed_step_s8e1*_h200, tpot_burst*_s8e1_h200) an 8k-token mixed step's ops 101.51 ->
# 101.38 ms (norms 2.98 -> 2.11, but o_proj +0.16 and down +0.19 reading C, and rms_norm_rows runs at 69 %
# of copy bandwidth); the 256 x 1k/128 burst's mixed steps 108.25 -> 107.82 ms on the device, decode p50
# 14.168 -> 14.116 ms, busy 5,220 -> 5,198 ms (-0.4 %), 6,258 vs 6,236 tok/s (noise).
RESIDUAL_GEMM_ENV = "OPENINFER_RESIDUAL_GEMM"


@functools.cache
def residual_gemm_wanted() -> bool:
    """``OPENINFER_RESIDUAL_GEMM`` ("0" default, "1"), read once per process."""
    value = os.environ.get(RESIDUAL_GEMM_ENV, "0").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{RESIDUAL_GEMM_ENV}={value!r}: expected '0' or '1'")
    return value == "1"


@dataclass
class CudaLinear:
    weight: cupy.ndarray  # [out_features, in_features] bf16 (uint16)
    bias: cupy.ndarray | None  # [out_features] bf16 or None

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])


# Deleted after losing: OPENINFER_DECODE_PDL / OPENINFER_GEMV_PDL, programmatic dependent launch of the
# one-row GEMVs (their first weight loads before griddepcontrol.wait), the decode routers and the lane-groups
# INT4 GEMV. s15 D1 / D2 (H200, Kimi-K2 layer b1 graph, alternated; results/kimi_layer_b1_s15d1_h200.json,
# kimi_layer_b1_s15d2_h200.json): gemv_pdl 191.7 / 193.1 us vs 174.6 / 174.8 (D1), decode_pdl 185.6 / 190.8 vs
# 173.6 / 173.7 (D2); each dense GEMV 3-4 us slower (qkv_a 10.6 -> 14.1, o_proj 31.5 -> 35.3, shared gate_up
# 16.4 -> 19.5). s12 D2 had measured 0.962x.


@functools.cache
def sm_count(device: int) -> int:
    """Device ``device``'s streaming multiprocessors (one attribute query per device)."""
    return int(cupy.cuda.Device(device).attributes["MultiProcessorCount"])


@contextlib.contextmanager
def gemv_beside_other_work() -> Iterator[None]:
    """One-row GEMVs launched inside run beside other work (see GEMV_M1_COLS_BESIDE_ENV)."""
    depth = getattr(_beside_other_work, "depth", 0)
    _beside_other_work.depth = depth + 1
    try:
        yield
    finally:
        _beside_other_work.depth = depth


def _columns_switch(env: str, default: str, allowed: tuple[str, ...]) -> str:
    text = os.environ.get(env, "").strip().lower() or default
    if text not in allowed:
        raise ValueError(f"{env} must be {', '.join(allowed[:-1])} or {allowed[-1]} (the columns a warp of gemv_m1 "
                         f"owns), got {text!r}")
    return text


def gemv_m1_columns(out_features: int) -> int:
    """The columns a warp of gemv_m1 owns for ``out_features`` outputs: $OPENINFER_GEMV_M1_COLS (see
    GEMV_M1_COLS_ENV; "auto": 2 where one column a warp takes more than a wave of blocks, else 1), at least
    $OPENINFER_GEMV_M1_COLS_BESIDE inside ``gemv_beside_other_work``."""
    text = _columns_switch(GEMV_M1_COLS_ENV, DEFAULT_GEMV_M1_COLS, ("auto", "1", "2", "4"))
    if text == "auto":
        wave = GEMV_M1_BLOCKS_PER_SM * sm_count(cupy.cuda.Device().id)
        cols = 2 if -(-out_features // GEMV_WARPS_PER_BLOCK) > wave else 1
    else:
        cols = int(text)
    if getattr(_beside_other_work, "depth", 0):
        beside = _columns_switch(GEMV_M1_COLS_BESIDE_ENV, str(DEFAULT_GEMV_M1_COLS_BESIDE), ("1", "2", "4"))
        cols = max(cols, int(beside))
    return cols


def skinny_gemm(x: cupy.ndarray, layer: CudaLinear, out: cupy.ndarray) -> None:
    """``out = x @ W^T (+ bias)`` through gemv.cu, for at most 8 rows and in_features % 8 == 0."""
    m, k = x.shape
    n = layer.out_features
    rows = 1 if m == 1 else 2 if m == 2 else 4 if m <= 4 else 8
    cols = gemv_m1_columns(n) if rows == 1 else GEMV_COLUMNS_PER_WARP[rows]
    # a 1-column gemv_m1 defines nothing more: its kernel and cache entry as before GEMV_M1_COLS
    defines = {"GEMV_M1_COLS": cols} if rows == 1 and cols != 1 else {}
    bias = layer.bias if layer.bias is not None else NULL
    args = (x, layer.weight, bias, out, np.int32(m), np.int32(n), np.int32(k))
    kernel("gemv.cu", f"gemv_m{rows}", **defines)((-(-n // (GEMV_WARPS_PER_BLOCK * cols)),),
                                                 (GEMV_WARPS_PER_BLOCK * 32,), args)


FUSED_MAX_IN_FEATURES = 24576  # the fused GEMVs keep their bf16 input row in 48 KB of shared memory


@dataclass(frozen=True)
class FusedLaunch:
    """How a fused decode GEMV is launched: at most ``blocks_per_sm`` blocks per SM (each builds
    its input row once, then loops over column tiles; 44-50 registers x 256 threads and <= 48 KB
    of shared memory leave room for 8), each asking L2 for the first ``prefetch_bytes`` of its
    next tile's weight rows (0: none)."""

    blocks_per_sm: int = 8
    prefetch_bytes: int = 4096  # the first loop iteration's loads (8 x 512 B per row)


FUSED_LAUNCH = FusedLaunch()


def fusable(x: cupy.ndarray, layer: CudaLinear) -> bool:
    """Whether a decode row (M = 1) can take a fused norm/activation + GEMV kernel."""
    k = layer.in_features
    return x.shape[0] == 1 and GEMV_MAX_ROWS >= 1 and k % 8 == 0 and k <= FUSED_MAX_IN_FEATURES


def fused_grid(out_features: int, num_sms: int, blocks_per_sm: int) -> int:
    """Blocks for a fused GEMV of ``out_features`` columns: at most ``num_sms * blocks_per_sm``
    (all resident at once), and as few as give every block the same number of column tiles, so
    no block builds its input row for less work than the others."""
    tiles = -(-out_features // GEMV_WARPS_PER_BLOCK)
    most = max(1, num_sms * blocks_per_sm)
    tiles_per_block = -(-tiles // most)
    return -(-tiles // tiles_per_block)


def fused_add_rms_norm_gemv(x: cupy.ndarray, residual: cupy.ndarray | None, norm_weight: cupy.ndarray, eps: float,
                            norm_threads: int, layer: CudaLinear, num_sms: int,
                            launch: FusedLaunch = FUSED_LAUNCH) -> tuple[cupy.ndarray, cupy.ndarray]:
    """``(rms_norm(x + residual) @ W^T (+ bias), x + residual)`` for one row, in one launch
    (gemv.cu ``gemv_m1_add_rms_norm``); with ``residual`` None: ``(rms_norm(x) @ W^T, x)``.
    Bit-identical to ``add_rms_norm`` then ``linear``, whatever the grid."""
    k, n = layer.in_features, layer.out_features
    out = cupy.empty((1, n), dtype=cupy.uint16)
    residual_out = cupy.empty_like(x) if residual is not None else x
    kernel("gemv.cu", "gemv_m1_add_rms_norm")(
        (fused_grid(n, num_sms, launch.blocks_per_sm),), (GEMV_WARPS_PER_BLOCK * 32,),
        (x, residual if residual is not None else NULL, norm_weight, np.float32(eps), np.int32(norm_threads),
         layer.weight, layer.bias if layer.bias is not None else NULL, out,
         residual_out if residual is not None else NULL, np.int32(n), np.int32(k), np.int32(launch.prefetch_bytes)),
        shared_mem=2 * k)
    return out, residual_out


def fused_silu_mul_gemv(gate_up: cupy.ndarray, layer: CudaLinear, num_sms: int,
                        launch: FusedLaunch = FUSED_LAUNCH) -> cupy.ndarray:
    """``silu_mul(gate_up) @ W^T (+ bias)`` for one row in one launch (``gemv_m1_silu_mul``),
    bit-identical to ``silu_mul`` then ``linear``, whatever the grid."""
    k, n = layer.in_features, layer.out_features
    out = cupy.empty((1, n), dtype=cupy.uint16)
    kernel("gemv.cu", "gemv_m1_silu_mul")(
        (fused_grid(n, num_sms, launch.blocks_per_sm),), (GEMV_WARPS_PER_BLOCK * 32,),
        (gate_up, layer.weight, layer.bias if layer.bias is not None else NULL, out, np.int32(n), np.int32(k),
         np.int32(launch.prefetch_bytes)),
        shared_mem=2 * k)
    return out


# OPENINFER_RMS_SCALED_GEMV=1 (opt-in until measured): ``rms_norm(x) @ W^T`` for one row as one launch,
# gemv.cu ``gemv_m1_rms_scaled`` (each warp sums x² over the row it walks anyway and scales its column's
# Σ x·g·w at the end: no normalised row, no norm launch; within bf16 rounding of the two launches, not
# their bits). Where the CUDA backend's add_rms_norm_linear has no residual (Kimi-K2 / DeepSeek-V3's
# q_a_norm + q_b at batch 1: rms_norm + gemv_m1 17.4 us in s11 D3's breakdown, gemv_m1 alone 12.2).
# (At gemv_m1's columns a warp, RMS_SCALED_COLS = 2 for q_b under the kernel's 5-blocks-an-SM launch bounds: s16 D11,
# H200, Kimi-K2 layer b1 graph, alternated, results/kimi_layer_b1_s16d11_h200.json: 186.8 / 185.5 / 185.7 / 185.3 us
# vs 166.8 / 165.6 / 166.1 / 167.6 without the switch; deleted. Two columns' 12 raw words a lane do not fit the
# ~51 registers those bounds leave.)
RMS_SCALED_GEMV_ENV = "OPENINFER_RMS_SCALED_GEMV"
DEFAULT_RMS_SCALED_GEMV = False


def rms_scaled_wanted(x: cupy.ndarray, layer: CudaLinear) -> bool:
    """Whether ``rms_norm_gemv`` runs ``rms_norm(x) @ W^T``: the switch (1 / 0, unset: the default; another
    value: a clear error), one row, in_features % 8 == 0, 16-byte aligned rows."""
    value = os.environ.get(RMS_SCALED_GEMV_ENV, "").strip().lower()
    if value not in ("", "0", "1", "true", "false", "on", "off"):
        raise ValueError(f"{RMS_SCALED_GEMV_ENV} must be 1 or 0, got {value!r}")
    on = DEFAULT_RMS_SCALED_GEMV if value == "" else value in ("1", "true", "on")
    return (on and x.ndim == 2 and x.shape[0] == 1 and x.shape[1] == layer.in_features
            and layer.in_features % 8 == 0 and x.data.ptr % 16 == 0 and layer.weight.data.ptr % 16 == 0)


def rms_norm_gemv(x: cupy.ndarray, norm_weight: cupy.ndarray, eps: float, layer: CudaLinear) -> cupy.ndarray:
    """``rms_norm(x, norm_weight, eps) @ W^T (+ bias)`` for one bf16 row in one launch (``gemv_m1_rms_scaled``);
    the caller checks ``rms_scaled_wanted``."""
    n, k = layer.out_features, layer.in_features
    out = cupy.empty((1, n), dtype=cupy.uint16)
    kernel("gemv.cu", "gemv_m1_rms_scaled")(
        (-(-n // GEMV_WARPS_PER_BLOCK),), (GEMV_WARPS_PER_BLOCK * 32,),
        (cupy.ascontiguousarray(x), norm_weight, np.float32(eps), layer.weight,
         layer.bias if layer.bias is not None else NULL, out, np.int32(n), np.int32(k)))
    return out


# (OPENINFER_L2_WEIGHT_PREFETCH_MB, o_proj's last 16 / 32 / 48 MB into L2 during the MLA at b1, deleted: s15 D2 (H200,
# results/kimi_layer_b1_s15d2_h200.json) 178.1 / 176.7, 179.4 / 180.0, 179.0 / 178.3 us vs 173.6 / 173.7 without.)


def _add_bias(out: cupy.ndarray, bias: cupy.ndarray) -> None:
    rows, features = out.shape
    blocks = min(4096, (out.size + 255) // 256)
    kernel("elementwise.cu", "add_bias_bf16")((blocks,), (256,), (out, bias, np.int64(rows), np.int32(features)))


def linear(x: cupy.ndarray, layer: CudaLinear, blas: Cublas, use_gemv: bool = True,
           row_buckets: Sequence[int] = ()) -> cupy.ndarray:
    """``x [M, in] @ W^T (+ bias) -> [M, out]`` in bf16.

    ``row_buckets`` (sorted): a cuBLAS GEMM of M rows runs as the smallest bucket holding M (the
    extra rows computed and dropped), so that it takes a kernel already loaded (``row_buckets``
    module: a first use waits for the whole device)."""
    if x.ndim != 2 or x.shape[1] != layer.in_features:
        raise ValueError(f"linear expects x of shape [tokens, {layer.in_features}], got {tuple(x.shape)}")
    x = cupy.ascontiguousarray(x)
    m = x.shape[0]
    if m == 0:
        return cupy.empty((0, layer.out_features), dtype=cupy.uint16)
    if use_gemv and m <= GEMV_MAX_ROWS and layer.in_features % 8 == 0:
        out = cupy.empty((m, layer.out_features), dtype=cupy.uint16)
        skinny_gemm(x, layer, out)
        return out
    rows = padded_rows(m, row_buckets)
    if rows != m:  # the extra rows' inputs are left as they are: rows of a GEMM do not mix
        padded = cupy.empty((rows, layer.in_features), dtype=cupy.uint16)
        padded[:m] = x
        x = padded
    out = cupy.empty((rows, layer.out_features), dtype=cupy.uint16)
    blas.matmul_nt(x, layer.weight, out)
    out = out[:m]
    if layer.bias is not None:
        _add_bias(out, layer.bias)
    return out


def accumulates(rows: int, layer: CudaLinear, use_gemv: bool = True, row_buckets: Sequence[int] = ()) -> bool:
    """Whether ``linear_accumulate`` takes a GEMM of ``rows`` rows through ``layer``: cuBLAS rows
    (past the GEMV's), no padding to a bucket (the padded rows would land past the residual) and
    no bias (it would be added after the sum)."""
    return (rows > 0 and not (use_gemv and rows <= GEMV_MAX_ROWS) and padded_rows(rows, row_buckets) == rows
            and layer.bias is None)


def linear_accumulate(x: cupy.ndarray, layer: CudaLinear, into: cupy.ndarray, blas: Cublas, use_gemv: bool = True,
                      row_buckets: Sequence[int] = ()) -> bool:
    """``into += x @ W^T`` in place, one GEMM with beta = 1 (fp32 sum of the product and
    ``into``'s bf16 values, rounded once); False, with nothing done, where ``accumulates`` says
    no or ``into`` is not a C-contiguous bf16 ``[rows, out_features]`` array (the caller then
    runs ``linear`` and adds)."""
    if x.ndim != 2 or x.shape[1] != layer.in_features:
        raise ValueError(f"linear_accumulate expects x of shape [tokens, {layer.in_features}], got {tuple(x.shape)}")
    rows = x.shape[0]
    if (into.shape != (rows, layer.out_features) or into.dtype != cupy.uint16 or not into.flags.c_contiguous
            or not accumulates(rows, layer, use_gemv, row_buckets)):
        return False
    blas.matmul_nt(cupy.ascontiguousarray(x), layer.weight, into, accumulate=True)
    return True
