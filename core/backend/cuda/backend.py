"""CudaBackend: the Backend protocol in bf16 on one NVIDIA GPU (CuPy + our kernels + cuBLAS).

Activations, weights and KV are ``uint16`` CuPy arrays holding bf16 bits; kernels compute in
fp32. Every op launches on CuPy's current stream and allocates from CuPy's memory pool, so a
whole forward step can be captured into a CUDA graph (see ``openinfer.graph``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import cupy
import numpy as np

from openinfer.backend.base import AttentionSpec, ForwardBatch, KVLayer, StateLayer, allocate_cache
from openinfer.backend.cuda import attention as attention_ops
from openinfer.backend.cuda.batch import BatchUploader, CudaBatch, StaticBatch, StaticPrefillBatch
from openinfer.backend.cuda.bf16 import float_to_bf16_bits
from openinfer.backend.cuda.cublas import Cublas
from openinfer.backend.cuda.kernel_choices import kernel_choices
from openinfer.backend.cuda.linear import (
    FUSED_LAUNCH,
    GEMV_MAX_ROWS,
    CudaLinear,
    FusedLaunch,
    accumulates,
    fusable,
    fused_add_rms_norm_gemv,
    fused_silu_mul_gemv,
    linear,
    linear_accumulate,
    residual_gemm_wanted,
    rms_norm_gemv,
    rms_scaled_wanted,
)
from openinfer.backend.cuda.loader import (
    compile_kernels,
    discover_kernels,
    discovering,
    kernel,
    mark_serving,
    start_compiling,
)
from openinfer.backend.cuda.sampler import sample_rows, sample_rows_async
from openinfer.backend.cuda.weight_upload import uploader
from openinfer.engine_core.startup import note_event

note_event("cuda_backend_imported")  # CuPy and the CUDA backend's modules

logger = logging.getLogger("openinfer.backend.cuda")

SILU_MUL_ROWS_ENV = "OPENINFER_SILU_MUL_ROWS"  # "auto" (default) | "1" | "0": silu_mul over a (row, chunk) grid
SILU_MUL_ROWS_THREADS = 128  # silu_mul_rows: 2 x 128 vectors (2048 outputs) per block
# E2 (H200, gpu_elementwise.py, 9728 outputs per row): silu_mul_rows / vec8 1.04x at 1k rows, 1.35x at
# 8k, 1.54x at 16k (362 -> 235 us, 64 -> 98 % of copy bandwidth); 0.87x / 0.88x at 256 / 1 row
SILU_MUL_ROWS_MIN_ROWS = 1024
NORM_ROWS_PER_BLOCK = 4  # rms_norm.cu's row kernels: one warp per row, 4 rows per block
ACTIVATION_RESERVE_BYTES = 2 * 2**30  # activations of a 2048-token step + graph pools
# what every engine launches outside its forward (the sampler, graph-batch updates), whatever the model
STEP_KERNELS = (("sampling.cu", "sample_rows", ()), ("logit_constraints.cu", "apply_logit_constraints", ()),
                ("static_batch.cu", "scatter_int32", ()), ("static_batch.cu", "copy_token_sources", ()))


# "1" (default since s12 D2, with OPENINFER_EARLY_CUDA=driver and OPENINFER_WEIGHTS_JOIN=serve: see
# openinfer.engine_core.startup): the graphs' cuBLAS kernels (every capture row count x weight shape) are
# loaded while the start-up's kernels build (``precompile_kernels(gemm_rows=...)``), not one by one in the
# captures, and the discovery's dry runs launch no GEMM (their row counts join the load); "0": as before
GEMM_PRELOAD_ENV = "OPENINFER_GEMM_PRELOAD"


class _GemmRows:
    """A stand-in for ``Cublas`` in a dry run: records each GEMM's (rows, weight), launches nothing."""

    def __init__(self) -> None:
        self.pairs: dict[tuple[int, tuple[int, ...]], cupy.ndarray] = {}

    def matmul_nt(self, x: cupy.ndarray, weight: cupy.ndarray, out: cupy.ndarray, accumulate: bool = False) -> None:
        self.pairs.setdefault((int(x.shape[0]), tuple(weight.shape)), weight)


def _norm_threads(features: int) -> int:
    """rms_norm.cu's block size for a row of ``features`` (the fused GEMV reproduces its sum order):
    about two elements per thread, whole warps (block_sum's shuffles take all 32 lanes; the former
    ``ceil(features / 32) * 32 // 2`` gave half a warp for e.g. 520 features, a wrong sum)."""
    return min(1024, max(32, -(-features // 64) * 32))


# "1" (default): a mixed step's decode rows attend on a second stream beside the prompt chunks'
# prefill attention (memory bound beside compute bound); "0": one after the other on one stream.
# Default by E1 (H200, benchmarks/gpu_mixed_step.py, Qwen3-4B, one layer's mixed attention of an
# 8192-token step with 200 decodes at 1088 context): 559.6 -> 496.9 us (prefill part 294.3 + decode
# part 265.3 us alone), the same bits (tests/gpu/test_mixed_overlap.py). E2 (256-stream burst against =0, same
# window): mixed steps' device time 3,584 vs 3,595 ms, output 6,192 vs 6,232 tok/s (within run-to-run noise)
MIXED_OVERLAP_ENV = "OPENINFER_MIXED_OVERLAP"
BUCKET_GEMM_LOADS_ENV = "OPENINFER_BUCKET_GEMM_LOADS"  # "0": set_gemm_row_buckets runs no GEMMs
ROW_NORMS_ENV = "OPENINFER_ROW_NORMS"  # "auto" (default) | "1" | "0": rms_norm / add_rms_norm one warp per row
# E2 (H200, gpu_elementwise.py, 2560 features): add_rms_norm rows / block 1.05x at 256 rows, 2.1x at
# 1k, 2.5x at 8k / 16k (214 -> 84 us, 38 -> 97 % of copy bandwidth); rms_norm 3.2x at 16k; equal at 1-64
ROW_NORMS_MIN_ROWS = 256
# rms_norm.cu's row kernels hold a row (and the norm weight) in registers: up to 3072 features
# (12 vectors per lane: 177 / 208 registers, no spills; 16 spill)
ROW_NORM_MAX_VECTORS_PER_LANE = 12


def row_norm_vectors_per_lane(features: int, *arrays: cupy.ndarray) -> int:
    """VECS_PER_LANE of rms_norm.cu's one-warp-per-row kernels for rows of ``features``, or 0
    where they do not apply (a width not a multiple of 8, wider than 3072, or an unaligned array)."""
    vectors = -(-features // 256)
    if features % 8 or vectors > ROW_NORM_MAX_VECTORS_PER_LANE or any(a.data.ptr % 16 for a in arrays):
        return 0
    return vectors


def auto_switch(name: str) -> bool | None:
    """An "auto" | "1" | "0" environment switch: None (auto: the backend decides by size), True, False."""
    raw = os.environ.get(name, "auto")
    if raw not in ("auto", "1", "0"):
        raise ValueError(f"{name}={raw!r}: expected 'auto', '1' or '0'")
    return None if raw == "auto" else raw == "1"


def _int_env(name: str, default: int, minimum: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or int(raw) < minimum:
        raise ValueError(f"{name}={raw!r}: expected an integer >= {minimum}")
    return int(raw)


def _blocks(n: int, threads: int = 256, cap: int = 8192) -> int:
    return max(1, min(cap, (n + threads - 1) // threads))


def _bf16(x: Any, what: str) -> cupy.ndarray:
    if not isinstance(x, cupy.ndarray) or x.dtype != cupy.uint16:
        raise ValueError(f"{what} must be a bf16 (uint16) CuPy array from this backend, got "
                         f"{type(x).__name__} {getattr(x, 'dtype', '')}")
    return cupy.ascontiguousarray(x)


class CudaBackend:
    name = "cuda"
    xp = cupy
    activation_dtype = np.uint16  # bf16 bits
    kv_dtype = "bfloat16"  # the KV cache dtype name models put in their specs

    def __init__(self, device: int = 0, use_gemv: bool = True, fuse_decode: bool | None = None):
        note_event("backend_init_started")
        self.device = cupy.cuda.Device(device)
        self.device.use()
        props = cupy.cuda.runtime.getDeviceProperties(device)
        self.device_name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        self.num_sms = int(props["multiProcessorCount"])
        self.blas = Cublas()
        self.use_gemv = use_gemv
        self.gemm_row_buckets: tuple[int, ...] = ()  # set_gemm_row_buckets
        self._gemm_weights: dict[tuple[int, int], cupy.ndarray] = {}  # weight shape -> a weight of it
        self.gemm_warmups = 0  # bucket GEMMs set_gemm_row_buckets ran
        self.gemm_preloads = 0  # GEMMs precompile_kernels ran to load the graphs' cuBLAS kernels early
        self._dry_gemms: _GemmRows | None = None  # while a preloading discovery runs: its GEMMs' row counts
        # decode rows (M = 1): RMSNorm fused into the next projection's GEMV, SiLU·mul into
        # down-proj's (bit-identical results). Off unless OPENINFER_FUSED_DECODE=1: the first design
        # (one tile per block) took bs=1 decode from 3.29 to 4.26 ms on an H200 (benchmarks/GPU.md);
        # the second and third (one prologue per resident block looping over tiles, with whole-row /
        # 4 KB / no L2 prefetches) too: 3.09 -> 4.31 / 4.55 / 4.21 ms (H200, benchmarks/GPU.md)
        if fuse_decode is None:
            fuse_decode = os.environ.get("OPENINFER_FUSED_DECODE", "0") in ("1", "true", "on")
        self.fuse_decode = fuse_decode and use_gemv
        # the fused launches' shape (OPENINFER_FUSED_DECODE_BLOCKS_PER_SM / _PREFETCH_BYTES, for measuring)
        self.fused_launch = FusedLaunch(
            blocks_per_sm=_int_env("OPENINFER_FUSED_DECODE_BLOCKS_PER_SM", FUSED_LAUNCH.blocks_per_sm, minimum=1),
            prefetch_bytes=_int_env("OPENINFER_FUSED_DECODE_PREFETCH_BYTES", FUSED_LAUNCH.prefetch_bytes, minimum=0))
        # rms_norm / add_rms_norm on rms_norm.cu's one-warp-per-row kernels (16-byte accesses, the
        # row and weight in registers) instead of one block per row: None (auto) from
        # ROW_NORMS_MIN_ROWS rows (below, the block kernel is as fast and decode keeps its bits),
        # True for any rows (but a lone decode row under fused decode, whose GEMV reproduces the
        # block kernel's sum order), False never. OPENINFER_ROW_NORMS; gpu_elementwise.py times both.
        self.row_norms: bool | None = auto_switch(ROW_NORMS_ENV)
        # silu_mul on elementwise.cu's silu_mul_rows (a 2-D grid, two 16-byte vectors per thread, no
        # grid-stride loop; the same bits as silu_mul_vec8): None (auto) from SILU_MUL_ROWS_MIN_ROWS
        # rows, True always, False never (OPENINFER_SILU_MUL_ROWS)
        self.silu_mul_rows: bool | None = auto_switch(SILU_MUL_ROWS_ENV)
        self.uploader = BatchUploader()
        # every step's kernels are known now: they compile while the weights load
        start_compiling(STEP_KERNELS, self.device.id)
        self.ropes = attention_ops.RopeTables()
        # off by default: once a side stream has run a mixed step's decode rows, every later batch-1
        # graph step took ~130 us longer on the device (bs1 3.13 -> 3.00 ms with it off, E1 of
        # 2026-11-24 08:15, benchmarks/results/bs1_switches_s8e1_h200.json), and 256-stream bursts
        # measured no gain from it (6,192 on vs 6,232 off, s7 E2); "1" turns it on
        overlap = os.environ.get(MIXED_OVERLAP_ENV, "0")
        if overlap not in ("0", "1"):
            raise ValueError(f"{MIXED_OVERLAP_ENV}={overlap!r}: expected '0' or '1'")
        self.mixed_overlap = overlap == "1"
        self._side_stream: cupy.cuda.Stream | None = None  # made at the first overlapped mixed step
        note_event("backend_ready")

    def precompile_kernels(self, dry_run: Callable[[], Any], gemm_rows: Sequence[int] = ()) -> int:
        """Compile, in parallel, every kernel ``dry_run`` (a forward whose outputs are thrown
        away) would launch, and those of ``STEP_KERNELS``; returns the number of modules built. A dry run
        that fails part-way (outputs are garbage while discovering) still compiles what it met.
        ``gemm_rows``: the row counts the caller's graphs will run GEMMs at; unless
        ``OPENINFER_GEMM_PRELOAD=0`` their cuBLAS kernels (each with every weight shape the dry run
        met) are loaded while the kernels build, not at their first capture."""
        note_event("discovery_started")
        preload = os.environ.get(GEMM_PRELOAD_ENV, "1").strip() != "0"
        # with the preload the dry run launches no GEMM (its output is garbage anyway): a cuBLAS kernel's first
        # use waits for the whole device, and the dry run met ~20 of them before finding the last kernels
        self._dry_gemms = _GemmRows() if preload else None
        try:
            with discover_kernels(self.device.id) as wanted:  # each kernel's build starts when it is found
                try:
                    dry_run()
                except Exception:  # noqa: BLE001 — only discovery is lost; the real warm-up follows
                    logger.debug("the kernel-discovery forward stopped early", exc_info=True)
        finally:
            dry_pairs, self._dry_gemms = (self._dry_gemms.pairs if self._dry_gemms is not None else {}), None
        note_event("discovery_done", last=True)
        if preload:
            # the graphs' captures met ~100 first uses one after the other; here they load while NVRTC runs:
            # every graph row count with every weight shape, and the dry run's own (rows, weight) pairs exactly
            # (its 4k-token rows against the LM head, a GEMM no step runs, would take 1.2 GB for Qwen3-4B);
            # inputs from the default pool, as eager steps' are (not the caller's, e.g. the graphs' pool)
            with cupy.cuda.using_allocator(cupy.get_default_memory_pool().malloc):
                self.gemm_preloads += self._load_gemms(gemm_rows, dry_pairs)
            note_event("gemms_preloaded", last=True)
        built = compile_kernels([*wanted, *STEP_KERNELS], self.device.id)
        note_event("kernels_compiled", last=True)
        return built

    def mark_serving(self, serving: bool = True) -> None:
        """The engine's start-up is over (``True``) or begins (``False``): a kernel built while
        serving is a start-up discovery miss, logged and listed in ``loader.late_compiles``."""
        mark_serving(serving)

    # --- placing data ----------------------------------------------------------------------------

    def upload(self, array: np.ndarray) -> cupy.ndarray:
        return cupy.asarray(float_to_bf16_bits(np.asarray(array)))

    def weight(self, array: np.ndarray) -> cupy.ndarray:
        """bf16 device copy; uint16 input is taken as bf16 bits, float32 is narrowed on the GPU.
        Copied through the weight uploader (parallel, no pinned copy kept; see ``weight_upload``)."""
        array = np.asarray(array)
        if array.dtype != np.float32 or array.size < 2**16:
            return uploader(self.device.id).upload(float_to_bf16_bits(array))
        source = uploader(self.device.id).upload(array)
        out = cupy.empty(array.shape, dtype=cupy.uint16)
        kernel("elementwise.cu", "float_to_bf16")((_blocks(source.size),), (256,), (source, out, np.int64(source.size)))
        return out

    def linear_weight(self, weight: np.ndarray, bias: np.ndarray | None = None) -> CudaLinear:
        if weight.ndim != 2:
            raise ValueError(f"a linear weight is [out_features, in_features], got shape {weight.shape}")
        return CudaLinear(self.weight(weight), None if bias is None else self.weight(bias))

    def fused_linear_weight(self, weights: Sequence[np.ndarray],
                            biases: Sequence[np.ndarray] | None = None) -> CudaLinear:
        """``linear_weight(fuse_rows(*weights), fuse_rows(*biases))`` with no fused copy on the
        host: each bf16 part goes straight into its rows of the device matrix."""
        if any(w.ndim != 2 or w.shape[1] != weights[0].shape[1] for w in weights) or any(
                np.asarray(w).dtype != np.uint16 for w in weights):
            return self.linear_weight(np.concatenate(weights, axis=0),
                                      None if biases is None else np.concatenate(biases, axis=0))
        out = cupy.empty((sum(w.shape[0] for w in weights), weights[0].shape[1]), dtype=cupy.uint16)
        offset = 0
        for part in weights:
            uploader(self.device.id).upload(part, out, offset)
            offset += part.nbytes
        return CudaLinear(out, None if biases is None else self.weight(np.concatenate(biases, axis=0)))

    def prepare_batch(self, batch: ForwardBatch) -> CudaBatch:
        return self.uploader.upload(batch)

    def static_batch(self, num_seqs: int, max_blocks_per_seq: int, num_groups: int = 1,
                     with_state: bool = False) -> StaticBatch:
        """Fixed-address decode inputs for a CUDA graph of ``num_seqs`` sequences (per KV cache
        group tables when ``num_groups`` > 1, state slots when ``with_state``)."""
        return StaticBatch(self.uploader, num_seqs, max_blocks_per_seq, num_groups, with_state)

    def static_prefill_batch(self, num_seqs: int, num_tokens: int, max_blocks_per_seq: int,
                             max_query_len: int) -> StaticPrefillBatch:
        """Fixed-address inputs for a CUDA graph of a short prefill step (``StaticPrefillBatch``)."""
        return StaticPrefillBatch(self.uploader, num_seqs, num_tokens, max_blocks_per_seq, max_query_len)

    def allocate_kv(self, spec: Any, num_blocks: int, block_size: int = 0, *legacy: int) -> KVLayer | StateLayer:
        """One layer's cache for a ``KVCacheSpec`` (bf16 stored as uint16; see ``Backend.allocate_kv``)."""
        return allocate_cache(cupy, spec, num_blocks, block_size, *legacy, default_dtype=self.kv_dtype)

    def to_host(self, x: Any) -> np.ndarray:
        if isinstance(x, cupy.ndarray) and x.dtype == cupy.uint16:
            return (cupy.ascontiguousarray(x).astype(cupy.uint32) << 16).view(cupy.float32).get()
        return np.asarray(cupy.asnumpy(x), dtype=np.float32)

    def synchronize(self) -> None:
        cupy.cuda.get_current_stream().synchronize()

    # --- ops -------------------------------------------------------------------------------------

    def gather_rows(self, x: cupy.ndarray, rows: Any) -> cupy.ndarray:
        x = _bf16(x, "gather_rows input")
        rows = cupy.asarray(rows, dtype=cupy.int32)
        features = x.shape[-1]
        out = cupy.empty((rows.shape[0], features), dtype=cupy.uint16)
        if rows.shape[0]:
            kernel("elementwise.cu", "gather_rows")((rows.shape[0],), (128,),
                                                    (x, rows, out, np.int32(rows.shape[0]), np.int32(features)))
        return out

    def embedding(self, table: cupy.ndarray, token_ids: Any) -> cupy.ndarray:
        return self.gather_rows(table, token_ids)

    def _row_norms_for(self, rows: int) -> bool:
        if self.row_norms is None:
            return rows >= ROW_NORMS_MIN_ROWS
        return self.row_norms and rows > 0 and (rows > 1 or not self.fuse_decode)

    def rms_norm(self, x: cupy.ndarray, weight: cupy.ndarray, eps: float) -> cupy.ndarray:
        x = _bf16(x, "rms_norm input")
        features = x.shape[-1]
        out = cupy.empty_like(x)
        rows = x.size // features
        vectors = row_norm_vectors_per_lane(features, x, weight) if self._row_norms_for(rows) else 0
        if vectors:
            kernel("rms_norm.cu", "rms_norm_rows", VECS_PER_LANE=vectors)(
                (-(-rows // NORM_ROWS_PER_BLOCK),), (32 * NORM_ROWS_PER_BLOCK,),
                (x, weight, out, np.int32(rows), np.int32(features), np.float32(eps)))
        elif rows:
            kernel("rms_norm.cu", "rms_norm")((rows,), (_norm_threads(features),),
                                              (x, weight, out, np.int32(features), np.float32(eps)))
        return out

    def add_rms_norm(self, x: cupy.ndarray, residual: cupy.ndarray, weight: cupy.ndarray,
                     eps: float) -> tuple[cupy.ndarray, cupy.ndarray]:
        x, residual = _bf16(x, "add_rms_norm input"), _bf16(residual, "add_rms_norm residual")
        if x.shape != residual.shape:
            raise ValueError(f"add_rms_norm: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
        features = x.shape[-1]
        out, residual_out = cupy.empty_like(x), cupy.empty_like(x)
        rows = x.size // features
        vectors = (row_norm_vectors_per_lane(features, x, residual, weight)
                   if self._row_norms_for(rows) else 0)
        if vectors:
            kernel("rms_norm.cu", "add_rms_norm_rows", VECS_PER_LANE=vectors)(
                (-(-rows // NORM_ROWS_PER_BLOCK),), (32 * NORM_ROWS_PER_BLOCK,),
                (x, residual, weight, out, residual_out, np.int32(rows), np.int32(features), np.float32(eps)))
        elif rows:
            kernel("rms_norm.cu", "add_rms_norm")(
                (rows,), (_norm_threads(features),),
                (x, residual, weight, out, residual_out, np.int32(features), np.float32(eps)))
        return out, residual_out

    def linear(self, x: cupy.ndarray, weight: CudaLinear) -> cupy.ndarray:
        if not self.gemm_row_buckets:  # until set_gemm_row_buckets: the weight shapes it loads kernels for
            self._gemm_weights.setdefault(tuple(weight.weight.shape), weight.weight)
        return linear(_bf16(x, "linear input"), weight, self._blas(), self.use_gemv, self.gemm_row_buckets)

    def _blas(self) -> Cublas | _GemmRows:
        """cuBLAS, or in a preloading discovery's dry run the recorder of its GEMMs' row counts."""
        return self._dry_gemms if self._dry_gemms is not None and discovering() else self.blas

    def set_gemm_row_buckets(self, buckets: Sequence[int]) -> None:
        """Row counts whose cuBLAS kernels are loaded (the CUDA graphs' buckets, after capture):
        smaller GEMMs run padded to one of them (``linear.linear``). Empty: no padding.

        Each bucket then runs one GEMM with every weight shape seen so far: the captures load
        only the (rows, weight) pairs they ran, yet an eager step pads e.g. its LM head's rows to
        a short-prefill graph's token count (70 rows -> 79), a pair no capture ran, and a kernel's
        first load waits for the whole device (E1, H200, 256-stream burst: that step's host
        launch 220 ms, ~15 ms of device idle, in every run)."""
        self.gemm_row_buckets = tuple(sorted(set(int(b) for b in buckets)))
        if os.environ.get(BUCKET_GEMM_LOADS_ENV, "1") != "0":
            self.gemm_warmups = self._load_bucket_gemms()
        tuned = self.blas.tuned
        if tuned is not None:  # called after graph capture: the decode shapes are tuned by now
            logger.info("cuBLASLt tuned %d GEMM shapes in %.2f s (%d from the tuning cache; %d kept a pick other "
                        "than the heuristic's first, %d a split-K copy)", len(tuned.shapes), tuned.tuning_seconds,
                        tuned.cached_shapes, sum(1 for s in tuned.report() if s["chosen"] > 0),
                        sum(1 for s in tuned.report() if s["split_k"] > 1))

    def _load_bucket_gemms(self) -> int:
        """One GEMM per (bucket past the GEMV rows, weight shape seen), on zero inputs (loads each
        pair's cuBLAS kernel now, on an idle device); returns how many ran."""
        return self._load_gemms(self.gemm_row_buckets)

    def _load_gemms(self, row_counts: Sequence[int],
                    pairs: dict[tuple[int, tuple[int, ...]], cupy.ndarray] | None = None) -> int:
        """One GEMM per (row count past the GEMV rows, weight shape seen) and per ``pairs`` entry
        ((rows, weight shape) -> a weight of it), on zero inputs: loads each pair's cuBLAS kernel
        now; returns how many ran."""
        todo = dict(pairs or {})
        for shape, weight in self._gemm_weights.items():
            for rows in set(int(r) for r in row_counts):
                todo.setdefault((rows, shape), weight)
        count = 0
        for (rows, (out_features, in_features)), weight in sorted(todo.items(), key=lambda item: item[0]):
            if rows <= GEMV_MAX_ROWS:
                continue
            x = cupy.zeros((rows, in_features), dtype=cupy.uint16)
            self.blas.matmul_nt(x, weight, cupy.empty((rows, out_features), dtype=cupy.uint16))
            count += 1
        cupy.cuda.get_current_stream().synchronize()
        return count

    def add_rms_norm_linear(self, x: cupy.ndarray, residual: cupy.ndarray | None, weight: cupy.ndarray, eps: float,
                            layer: CudaLinear) -> tuple[cupy.ndarray, cupy.ndarray]:
        """``(linear(rms_norm(x + residual)), x + residual)``; residual None: ``(linear(rms_norm(x)), x)``.
        One fused launch for a decode row, else the two ops (the same numbers either way)."""
        x = _bf16(x, "add_rms_norm_linear input")
        if self.fuse_decode and x.ndim == 2 and x.shape[1] == layer.in_features and fusable(x, layer):
            if residual is not None:
                residual = _bf16(residual, "add_rms_norm_linear residual")
                if residual.shape != x.shape:
                    raise ValueError(f"add_rms_norm_linear: x {tuple(x.shape)} and residual "
                                     f"{tuple(residual.shape)} differ")
            return fused_add_rms_norm_gemv(x, residual, weight, eps, _norm_threads(x.shape[1]), layer,
                                           self.num_sms, self.fused_launch)
        if residual is None:
            if rms_scaled_wanted(x, layer):  # one launch, no normalised row (linear.RMS_SCALED_GEMV_ENV)
                return rms_norm_gemv(x, weight, eps, layer), x
            return self.linear(self.rms_norm(x, weight, eps), layer), x
        h, residual = self.add_rms_norm(x, residual, weight, eps)
        return self.linear(h, layer), residual

    def silu_mul_linear(self, gate_up: cupy.ndarray, layer: CudaLinear) -> cupy.ndarray:
        """``linear(silu_mul(gate_up))``: one fused launch for a decode row, else the two ops."""
        gate_up = _bf16(gate_up, "silu_mul_linear input")
        if (self.fuse_decode and gate_up.ndim == 2 and gate_up.shape[1] == 2 * layer.in_features
                and fusable(gate_up[:, : layer.in_features], layer)):
            return fused_silu_mul_gemv(gate_up, layer, self.num_sms, self.fused_launch)
        return self.linear(self.silu_mul(gate_up), layer)

    def linear_residual(self, x: cupy.ndarray, layer: CudaLinear, residual: cupy.ndarray,
                        silu_mul: bool = False) -> bool:
        """``residual += linear(x)`` (``silu_mul``: ``linear(silu_mul(x))``) in place, one GEMM with
        beta = 1, under ``OPENINFER_RESIDUAL_GEMM=1`` where ``linear.accumulates``; False: nothing
        done (the caller runs ``linear`` and ``add_rms_norm``)."""
        rows = x.shape[0] if x.ndim == 2 else 0
        if (not residual_gemm_wanted() or not isinstance(residual, cupy.ndarray) or residual.dtype != cupy.uint16
                or not residual.flags.c_contiguous or residual.shape != (rows, layer.out_features)
                or not accumulates(rows, layer, self.use_gemv, self.gemm_row_buckets)):
            return False  # checked before any work: False means nothing was launched
        x = self.silu_mul(x) if silu_mul else _bf16(x, "linear_residual input")
        return linear_accumulate(x, layer, residual, self._blas(), self.use_gemv, self.gemm_row_buckets)

    def silu_mul(self, gate_up: cupy.ndarray) -> cupy.ndarray:
        gate_up = _bf16(gate_up, "silu_mul input")
        half = gate_up.shape[-1] // 2
        rows = gate_up.size // gate_up.shape[-1]
        out = cupy.empty((*gate_up.shape[:-1], half), dtype=cupy.uint16)
        by_rows = rows >= SILU_MUL_ROWS_MIN_ROWS if self.silu_mul_rows is None else self.silu_mul_rows
        if by_rows and out.size and half % 8 == 0 and gate_up.data.ptr % 16 == 0:
            chunks = -(-(half // 8) // (2 * SILU_MUL_ROWS_THREADS))
            kernel("elementwise.cu", "silu_mul_rows")((rows, chunks), (SILU_MUL_ROWS_THREADS,),
                                                      (gate_up, out, np.int32(half // 8)))
        elif out.size and half % 8 == 0 and out.size // 8 < 2**30 and gate_up.data.ptr % 16 == 0:
            # 8 outputs per thread, 16-byte accesses (same bits as silu_mul)
            kernel("elementwise.cu", "silu_mul_vec8")((_blocks(out.size // 8),), (256,),
                                                      (gate_up, out, np.int32(out.size // 8), np.int32(half // 8)))
        elif out.size:
            kernel("elementwise.cu", "silu_mul")((_blocks(out.size),), (256,),
                                                 (gate_up, out, np.int64(rows), np.int32(half)))
        return out

    def add(self, a: cupy.ndarray, b: cupy.ndarray) -> cupy.ndarray:
        a, b = _bf16(a, "add input"), _bf16(b, "add input")
        if a.shape != b.shape:
            raise ValueError(f"add: shapes {tuple(a.shape)} and {tuple(b.shape)} differ")
        out = cupy.empty_like(a)
        if a.size:
            kernel("elementwise.cu", "add_bf16")((_blocks(a.size),), (256,), (a, b, out, np.int64(a.size)))
        return out

    def attention(self, qkv: cupy.ndarray, spec: AttentionSpec, kv: KVLayer, batch: CudaBatch) -> cupy.ndarray:
        qkv = _bf16(qkv, "attention qkv")
        split = self._overlapped_split(spec, batch) if self.mixed_overlap else None
        if split is None:
            return attention_ops.attention(qkv, spec, kv, batch, self.ropes, self.num_sms)
        q = attention_ops.write_qkv(qkv, spec, kv, batch, self.ropes)
        if self._side_stream is None:
            self._side_stream = cupy.cuda.Stream(non_blocking=True)
        return attention_ops.mixed_attention(q, spec, kv, batch, split, self.num_sms, decode_stream=self._side_stream)

    def _overlapped_split(self, spec: AttentionSpec, batch: CudaBatch) -> Any:
        """The mixed split ``attention_ops.attend`` would take for this step, or None where it
        routes the step elsewhere (plain decode, short queries, no leading decode rows)."""
        if (batch.is_decode and batch.num_tokens == batch.num_seqs) or not kernel_choices().mixed_decode \
                or attention_ops.runs_short_query_kernel(spec, batch):
            return None
        return attention_ops.mixed_split(batch)

    def sample_rows(self, logits: cupy.ndarray, rows: Sequence[Any], eos_token_ids: Sequence[int],
                    masks: Any = None) -> list[Any]:
        """The engine's sampling hook: GPU sampling of ``logits [len(rows), vocab]`` (see ``sampler``);
        ``masks``: the step's structured-output masks (``runtime.sampler.GrammarMasks``) or None."""
        return sample_rows(_bf16(logits, "sample logits"), rows, eos_token_ids, self.to_host, masks)

    def sample_rows_async(self, logits: cupy.ndarray, rows: Sequence[Any],
                          masks: Any = None) -> tuple[cupy.ndarray, Any] | None:
        """Async scheduling: sample on the device, read back later (see ``sampler``); ``masks``:
        the step's structured-output masks or None."""
        return sample_rows_async(_bf16(logits, "sample logits"), rows, masks)

    def upload_token_ids(self, ids: np.ndarray) -> cupy.ndarray:
        return cupy.asarray(np.asarray(ids, np.int32))

    def fill_token_sources(self, batch: CudaBatch, previous_token_ids: cupy.ndarray, sources: np.ndarray) -> None:
        """Inputs sampled by the previous step, still on the device: ``token_ids[dest] = previous[src]``
        (``sources``: [n, 2] rows of (dest, src)), one kernel of ``STEP_KERNELS`` (built at start)."""
        count = int(sources.shape[0])
        if count == 0:
            return
        pairs = cupy.asarray(np.ascontiguousarray(sources, dtype=np.int32))
        previous = previous_token_ids if previous_token_ids.dtype == cupy.int32 else previous_token_ids.astype(cupy.int32)
        previous = cupy.ascontiguousarray(previous)
        kernel("static_batch.cu", "copy_token_sources")(
            (min(_blocks(count), 64),), (256,), (batch.token_ids, previous, pairs, np.int32(count)))

    def kv_memory_budget(self, options: Any) -> int:
        """Bytes for the KV pool: ``gpu_memory_utilization`` of the card, less what is in use
        (weights) and a reserve for activations and CUDA graphs."""
        free, total = cupy.cuda.runtime.memGetInfo()
        pool = cupy.get_default_memory_pool()
        in_use = (total - free) - (pool.total_bytes() - pool.used_bytes())  # pool's free blocks are reusable
        reserve = ACTIVATION_RESERVE_BYTES
        budget = int(options.gpu_memory_utilization * total) - in_use - reserve
        if budget <= 0:
            raise MemoryError(
                f"no GPU memory left for the KV cache: {in_use / 2**30:.1f} GiB in use of {total / 2**30:.1f} GiB "
                f"at gpu_memory_utilization={options.gpu_memory_utilization}; raise it or use a smaller model")
        return budget
