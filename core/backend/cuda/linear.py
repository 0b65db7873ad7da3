"""Linear layers: weights kept as HF lays them out, ``[out_features, in_features]`` bf16 rows.

That one layout serves both GEMM paths: cuBLAS ``gemmEx`` (TN, row-major ``x @ W^T``) and our
skinny GEMM ``gemv.cu`` (one warp streams one weight row). Fused projections (qkv, gate_up) are
simply their row blocks stacked. Decode-sized inputs (at most ``GEMV_MAX_ROWS`` rows) take the
skinny kernel, which reads each weight byte once at close to copy bandwidth; the rest cuBLAS.
"""

from __future__ import annotations

from dataclasses import dataclass

import cupy
import numpy as np

from openinfer.backend.cuda.cublas import Cublas
from openinfer.backend.cuda.loader import kernel

GEMV_MAX_ROWS = 1  # measured on H200: gemv_m2..m8 lose to cuBLAS (bs 2-8 decode 4.3-10.7 ms vs 4.3)
GEMV_WARPS_PER_BLOCK = 8
GEMV_COLUMNS_PER_WARP = {1: 1, 2: 2, 4: 4, 8: 4}  # per kernel gemv_m{rows}, as in gemv.cu
NULL = np.uint64(0)


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


def skinny_gemm(x: cupy.ndarray, layer: CudaLinear, out: cupy.ndarray) -> None:
    """``out = x @ W^T (+ bias)`` through gemv.cu, for at most 8 rows and in_features % 8 == 0."""
    m, k = x.shape
    n = layer.out_features
    rows = 1 if m == 1 else 2 if m == 2 else 4 if m <= 4 else 8
    columns_per_block = GEMV_WARPS_PER_BLOCK * GEMV_COLUMNS_PER_WARP[rows]
    grid = (n + columns_per_block - 1) // columns_per_block
    bias = layer.bias if layer.bias is not None else NULL
    kernel("gemv.cu", f"gemv_m{rows}")((grid,), (GEMV_WARPS_PER_BLOCK * 32,),
                                       (x, layer.weight, bias, out, np.int32(m), np.int32(n), np.int32(k)))


def _add_bias(out: cupy.ndarray, bias: cupy.ndarray) -> None:
    rows, features = out.shape
    blocks = min(4096, (out.size + 255) // 256)
    kernel("elementwise.cu", "add_bias_bf16")((blocks,), (256,), (out, bias, np.int64(rows), np.int32(features)))


def linear(x: cupy.ndarray, layer: CudaLinear, blas: Cublas, use_gemv: bool = True) -> cupy.ndarray:
    """``x [M, in] @ W^T (+ bias) -> [M, out]`` in bf16."""
    if x.ndim != 2 or x.shape[1] != layer.in_features:
        raise ValueError(f"linear expects x of shape [tokens, {layer.in_features}], got {tuple(x.shape)}")
    x = cupy.ascontiguousarray(x)
    m = x.shape[0]
    out = cupy.empty((m, layer.out_features), dtype=cupy.uint16)
    if m == 0:
        return out
    if use_gemv and m <= GEMV_MAX_ROWS and layer.in_features % 8 == 0:
        skinny_gemm(x, layer, out)
        return out
    blas.matmul_nt(x, layer.weight, out)
    if layer.bias is not None:
        _add_bias(out, layer.bias)
    return out
