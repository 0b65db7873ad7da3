"""cuBLAS ``cublasGemmEx`` through its C API (ctypes), so GEMMs can be captured in CUDA graphs.

CuPy's own cuBLAS wrapper refuses to run during stream capture; the C library captures fine
when called with our own handle, bound to the current stream and given a preallocated
workspace (no allocation inside capture).

``OPENINFER_GEMM_TUNING=1`` (opt-in; E1, H200, Qwen3-4B 256-stream burst against the default in
the same window: 6,039 vs 6,231 tok/s, batch-256 decode step 14.02 vs 13.85 ms, graph capture
+0.28 s, with candidates then timed L2-hot; E2, timed behind L2 flushes: the projections of a
batch-256 decode step 3.73 -> 3.59 ms alone, yet the burst 5,936 vs the default's 6,022 tok/s
and graph capture 0.24 -> 2.08 s): GEMMs of at most
``TUNED_MAX_ROWS`` rows (decode batches, the CUDA graphs' buckets) go through cuBLASLt with the
algorithm *timed* fastest among cuBLASLt's heuristic candidates for that exact (M, N, K), once
per shape (``gemm_tuning``; ``OPENINFER_GEMM_SPLIT_K`` adds split-K copies of the candidates, and
the picks persist in ``OPENINFER_GEMM_TUNING_CACHE``'s file so a later start times nothing). cuBLAS's default pick for a few hundred rows covers an N of 2560
with a few dozen output tiles on 132 SMs (H200 decode at batch 256: the o/down/qkv projections
at 47-50 % of their roofline); a split-K or smaller-tile candidate fills the machine.
"""

from __future__ import annotations

import ctypes
import os
import threading

import cupy

from openinfer.backend.cuda.gemm_tuning import GEMM_TUNING_ENV, LtTunedGemm, tuning_wanted
from openinfer.errors import BackendUnavailableError

CUDA_R_16BF = 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
WORKSPACE_BYTES = 32 * 1024 * 1024


def _load_library() -> ctypes.CDLL:
    # Let CuPy load its cuBLAS first; dlopen by soname then returns that same library.
    try:
        cupy.cuda.device.get_cublas_handle()
    except Exception:  # noqa: BLE001 - the explicit names below still get a chance
        pass
    errors = []
    for name in ("libcublas.so.13", "libcublas.so.12", "libcublas.so"):
        try:
            return ctypes.CDLL(name)
        except OSError as exc:
            errors.append(str(exc))
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        return ctypes.CDLL(load_nvidia_dynamic_lib("cublas").abs_path)
    except Exception as exc:  # noqa: BLE001
        errors.append(str(exc))
    raise BackendUnavailableError(
        "could not load libcublas (tried libcublas.so.13/.12 and cuda.pathfinder): " + "; ".join(errors)
        + ". Install the CUDA toolkit's cuBLAS or the nvidia-cublas wheel matching your CuPy.")


class Cublas:
    """One cuBLAS handle with a fixed workspace; rebinds to the current stream when it changes."""

    def __init__(self) -> None:
        self.lib = _load_library()
        self.lib.cublasGemmEx.argtypes = [
            ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
            ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_int]
        self.handle = ctypes.c_void_p()
        self._check(self.lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        self.workspace = cupy.empty(WORKSPACE_BYTES, dtype=cupy.uint8)
        self._check(self.lib.cublasSetWorkspace_v2(self.handle, ctypes.c_void_p(self.workspace.data.ptr),
                                                   ctypes.c_size_t(WORKSPACE_BYTES)), "cublasSetWorkspace")
        self._stream = -1
        self._alpha = ctypes.c_float(1.0)
        self._beta = ctypes.c_float(0.0)
        self._beta_accumulate = ctypes.c_float(1.0)
        self._lock = threading.Lock()
        # cuBLASLt with timed algorithms for decode-sized GEMMs (None: off or unavailable)
        self.tuned: LtTunedGemm | None = None
        if tuning_wanted(os.environ.get(GEMM_TUNING_ENV)):
            self.tuned = LtTunedGemm.create(self.workspace)

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed with cuBLAS status {status}")

    def _bind_stream(self) -> None:
        stream = cupy.cuda.get_current_stream().ptr
        if stream != self._stream:
            self._check(self.lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(stream)), "cublasSetStream")
            self._stream = stream

    def matmul_nt(self, x: cupy.ndarray, weight: cupy.ndarray, out: cupy.ndarray, accumulate: bool = False) -> None:
        """``out[M, N] = x[M, K] @ weight[N, K]^T`` in bf16 with fp32 accumulation (row-major);
        ``accumulate``: ``out += x @ weight^T`` (beta = 1: ``out``'s bf16 values join the fp32 sum,
        one rounding to bf16 at the end), always on gemmEx (the tuned path writes, never adds)."""
        m, k = x.shape
        n = weight.shape[0]
        with self._lock:
            if not accumulate and self.tuned is not None and self.tuned.matmul_nt(x, weight, out):
                return
            self._bind_stream()
            beta = self._beta_accumulate if accumulate else self._beta
            # column-major view: out^T[N, M] = weight[N, K] . x^T[K, M]  ->  gemm(T, N, N, M, K)
            self._check(self.lib.cublasGemmEx(
                self.handle, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, ctypes.byref(self._alpha),
                ctypes.c_void_p(weight.data.ptr), CUDA_R_16BF, k,
                ctypes.c_void_p(x.data.ptr), CUDA_R_16BF, k, ctypes.byref(beta),
                ctypes.c_void_p(out.data.ptr), CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                "cublasGemmEx")

    def matmul_strided_batched(self, transa: bool, transb: bool, m: int, n: int, k: int,
                               a: cupy.ndarray, lda: int, stride_a: int, b: cupy.ndarray, ldb: int, stride_b: int,
                               c: cupy.ndarray, ldc: int, stride_c: int, batch: int) -> None:
        """Column-major ``C_i[m, n] = op(A_i) · op(B_i)`` for ``i < batch`` in bf16, fp32 accumulate
        (``cublasGemmStridedBatchedEx``; strides and leading dimensions in elements). MLA's
        per-head projections (W_UK into the query, W_UV out of the latent) use it."""
        with self._lock:
            self._bind_stream()
            self._check(self.lib.cublasGemmStridedBatchedEx(
                self.handle, CUBLAS_OP_T if transa else CUBLAS_OP_N, CUBLAS_OP_T if transb else CUBLAS_OP_N,
                ctypes.c_int(m), ctypes.c_int(n), ctypes.c_int(k), ctypes.byref(self._alpha),
                ctypes.c_void_p(a.data.ptr), CUDA_R_16BF, ctypes.c_int(lda), ctypes.c_longlong(stride_a),
                ctypes.c_void_p(b.data.ptr), CUDA_R_16BF, ctypes.c_int(ldb), ctypes.c_longlong(stride_b),
                ctypes.byref(self._beta), ctypes.c_void_p(c.data.ptr), CUDA_R_16BF, ctypes.c_int(ldc),
                ctypes.c_longlong(stride_c), ctypes.c_int(batch), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                "cublasGemmStridedBatchedEx")
