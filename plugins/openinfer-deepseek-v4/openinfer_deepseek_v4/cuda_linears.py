"""DeepSeek-V4's FP8 dense linears kept as stored on the GPU (``OPENINFER_DSV4_FP8_LINEAR=stream``).

The checkpoint's attention projections and shared experts are FP8 e4m3 with e8m0 scales per
128×128 block. By default they are dequantised to bf16 at load and run on cuBLAS; with the
setting ``stream`` they stay FP8 (half the bytes a decode step reads) and run core's
``moe_fp4.cu`` ``fp8_stream_linear``: the codes decoded to bf16 in registers as the tensor-core
MMA's A operand (W8A16, the same products as the dequantised weight), for steps of at most
``STREAM_MAX_ROWS`` rows; longer steps dequantise to a bf16 scratch and take cuBLAS (core
``moe.quantized_linear``). Imported only on a CUDA machine.

    Fp8Linear.codes   [N, K] uint8 e4m3          (shared with .core)
    Fp8Linear.scales  [⌈N/128⌉, ⌈K/128⌉] uint8 e8m0
    Fp8Linear.core    core ExpertLinear (E = 1, fp32 scales) for the long steps
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import cupy
import numpy as np

from openinfer import WeightLoadError
from openinfer.backend.cuda import moe as core_moe
from openinfer.backend.cuda.loader import kernel
from openinfer.quant import e8m0_to_float32
from openinfer_deepseek_v4 import kernel_plan
from openinfer_deepseek_v4.cuda_ops import multiprocessors

FP8_BLOCK = 128
STREAM_N = 64  # moe_fp4.cu: weight rows per stream block
STREAM_ROWS = 64  # moe_fp4.cu: rows of a block row (STREAM_TOKENS)
STREAM_THREADS = 128
STREAM_MAX_ROWS = 256  # steps up to this many rows take the stream kernel (each block row re-reads the weight)
STREAM_K_MULTIPLE = 32  # a lane reads whole 32-code groups
NULL = np.uint64(0)
STREAM_STAGES = kernel_plan.stream_stages_setting(os.environ)


def stream_defines(chunks: int, stages: str | None = None) -> dict[str, int]:
    """moe_fp4.cu's defines for a stream GEMM (FP4 experts or FP8 linear) of ``chunks`` column
    blocks (``stages`` None: ``OPENINFER_DSV4_STREAM_STAGES``); a ring of 2 is the source's own
    (no define: the kernels compile exactly as before the ring existed)."""
    depth = kernel_plan.stream_stages(STREAM_STAGES if stages is None else stages, chunks)
    return {"STREAM_CHUNKS": chunks, **({"STREAM_STAGES": depth} if depth != 2 else {})}


@dataclass
class Fp8Linear:
    """One dense linear, FP8 as stored (see the module docstring)."""

    codes: cupy.ndarray
    scales: cupy.ndarray
    core: core_moe.ExpertLinear

    @property
    def out_features(self) -> int:
        return int(self.codes.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.codes.shape[1])


def upload_fp8_linear(codes: Any, scales: Any) -> Fp8Linear:
    """e4m3 codes ``[N, K]`` and e8m0 block scales ``[⌈N/128⌉, ⌈K/128⌉]`` (both uint8, host or
    device arrays) → device."""
    out_features, in_features = codes.shape
    blocks = (-(-out_features // FP8_BLOCK), -(-in_features // FP8_BLOCK))
    if tuple(scales.shape) != blocks or in_features % STREAM_K_MULTIPLE:
        raise WeightLoadError(f"FP8 linear [{out_features}, {in_features}]: scales {tuple(scales.shape)}, expected "
                              f"{blocks} and in_features a multiple of {STREAM_K_MULTIPLE}")
    device_codes = cupy.ascontiguousarray(cupy.asarray(codes, dtype=cupy.uint8))
    host_scales = np.ascontiguousarray(cupy.asnumpy(scales), np.uint8)
    wide = cupy.asarray(e8m0_to_float32(host_scales))
    core = core_moe.ExpertLinear("fp8", device_codes[None], wide[None], out_features, in_features, block=FP8_BLOCK)
    return Fp8Linear(device_codes, cupy.asarray(host_scales), core)


def stored_fp8_linear(ckpt: Any, modules: Sequence[str], shape: tuple[int, int]) -> Fp8Linear | None:
    """``weights.DenseLinearLoader`` for cuda: the rows of ``modules`` stacked in order (one module,
    or a fused shared-expert gate_up) when every part is stored FP8 in one file and starts on a
    scale block; None otherwise (the caller then dequantises)."""
    stored = [ckpt.stored_quantized(m) for m in modules]
    if any(s is None or s[0] != "fp8" for s in stored):
        return None
    if any(s[1].shape[0] % FP8_BLOCK for s in stored[:-1]) or shape[1] % STREAM_K_MULTIPLE:
        return None
    codes = np.concatenate([s[1] for s in stored])
    if codes.shape != shape:
        raise WeightLoadError(f"FP8 linear {modules[0]}: codes {codes.shape}, expected {shape}")
    return upload_fp8_linear(codes, np.concatenate([s[2] for s in stored]))


def fp8_linear(x: cupy.ndarray, weight: Fp8Linear, blas: Any, method: str | None = None,
               splits: int | None = None, stages: str | None = None) -> cupy.ndarray:
    """``x [M, K] @ dequantize(W)ᵀ`` as bf16 ``[M, N]``. ``method`` (None: by M): ``stream``
    (``fp8_stream_linear``) or ``dequantize`` (bf16 scratch + cuBLAS). ``splits``: the stream
    kernel's K splits (None: ``kernel_plan.fp8_linear_splits``); ``stages``: its staging ring
    (None: ``OPENINFER_DSV4_STREAM_STAGES``)."""
    if x.ndim != 2 or x.shape[1] != weight.in_features or x.dtype != np.uint16:
        raise ValueError(f"an FP8 linear takes bf16 [rows, {weight.in_features}], got {x.dtype} {tuple(x.shape)}")
    rows = int(x.shape[0])
    if method is None:
        method = "stream" if rows <= STREAM_MAX_ROWS else "dequantize"
    if method not in ("stream", "dequantize"):
        raise ValueError(f"FP8 linear method {method!r}: expected stream or dequantize")
    x = cupy.ascontiguousarray(x)
    if method == "dequantize" or x.data.ptr % 16 or weight.codes.data.ptr % 16:  # the kernel's 16-byte copies
        return core_moe.quantized_linear(x, weight.core, blas, "dequantize")
    out = cupy.empty((rows, weight.out_features), dtype=cupy.uint16)
    if rows:
        # rows of a block row in passes of 8 · chunks: up to 16 rows two passes' worth, else all 64 at once
        chunks = 1 if rows <= 8 else 2 if rows <= 16 else 8
        splits = kernel_plan.fp8_linear_splits(rows, weight.out_features, weight.in_features, multiprocessors()) \
            if splits is None else splits
        partial = cupy.empty((splits, rows, weight.out_features), np.float32) if splits > 1 else None
        kernel("moe_fp4.cu", "fp8_stream_linear", **stream_defines(chunks, stages))(
            (-(-weight.out_features // STREAM_N), -(-rows // STREAM_ROWS), splits), (STREAM_THREADS,),
            (x, weight.codes, weight.scales, out, NULL if partial is None else partial, np.int32(rows),
             np.int32(weight.out_features), np.int32(weight.in_features)))
        if partial is not None:
            kernel("moe_fp4.cu", "fp8_stream_reduce")((min(-(-out.size // 256), 1024),), (256,),
                                                     (partial, out, np.int64(out.size), np.int32(splits)))
    return out


def linear(ops: Any, x: cupy.ndarray, weight: Any) -> cupy.ndarray:
    """The model's dense linear: an ``Fp8Linear`` on its own kernels, anything else on the backend."""
    if isinstance(weight, Fp8Linear):
        return fp8_linear(x, weight, ops.blas)
    return ops.linear(x, weight)
