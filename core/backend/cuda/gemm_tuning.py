"""cuBLASLt GEMMs whose algorithm is timed once per shape (``OPENINFER_GEMM_TUNING=1``).

``out[M, N] = x[M, K] @ W[N, K]^T`` in bf16 with fp32 accumulation, as ``Cublas.matmul_nt``, for
``M <= TUNED_MAX_ROWS``. The first GEMM of an (M, N, K) asks cuBLASLt for up to
``CANDIDATES`` heuristic algorithms that fit the workspace, times each on a side stream with
the call's own buffers (every launch behind an L2 flush, as a step streams its weights from HBM),
and keeps the fastest; later calls (and CUDA graph captures) launch it
directly. Timing on a side stream keeps it legal inside a graph capture (the engine captures in
relaxed mode, which allows a side stream's work and synchronisation); the captured stream sees
only the final GEMM. Anything cuBLASLt refuses returns False and the caller runs ``gemmEx``.

``OPENINFER_GEMM_SPLIT_K=2,3,4`` (with tuning on; default none) also times, for every heuristic
candidate that supports split-K, a copy of it with each of those split counts (partial sums reduced
in fp32 in the workspace): cuBLAS's own picks for an N of 2560 at a few hundred rows cover the
machine with a few dozen output tiles.

The choices persist in a JSON file (``OPENINFER_GEMM_TUNING_CACHE``: a path, default
``~/.cache/openinfer/gemm_tuning.json``; "off" keeps them in memory): one entry per device, cuBLASLt
version, (M, N, K) and split counts offered, holding the kept algorithm's bytes. A later process
checks a cached algorithm with ``cublasLtMatmulAlgoCheck`` and launches it without timing anything
(graph capture then costs what it costs untuned); an entry cuBLASLt refuses, or a file that does
not parse, is timed afresh and rewritten.

Larger M (prefill and mixed steps: cuBLAS's default runs them at 87-99 % of its own peak) stay on
``gemmEx``, and so does every M when the switch is off: the default path is unchanged.

Column-major view of the row-major product (as ``Cublas.matmul_nt``)::

    out^T [N, M] = op_T(W) [N, K] . x^T [K, M]
    A = W:  K x N, ld K, transposed      B = x:  K x M, ld K      C = D = out:  N x M, ld N
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # CuPy is imported where it is used: CPU CI checks the pure helpers here
    import cupy

logger = logging.getLogger(__name__)

GEMM_TUNING_ENV = "OPENINFER_GEMM_TUNING"
SPLIT_K_ENV = "OPENINFER_GEMM_SPLIT_K"  # split counts timed beside the heuristic candidates
TUNING_CACHE_ENV = "OPENINFER_GEMM_TUNING_CACHE"  # a JSON path, or "off"
DEFAULT_TUNING_CACHE = Path("~/.cache/openinfer/gemm_tuning.json")
MAX_SPLIT_K = 16
TUNED_MAX_ROWS = 256  # the largest default decode bucket; eager GEMMs below it are padded to buckets
CANDIDATES = 16  # heuristic algorithms timed per shape
TIMING_REPEATS = 5  # launches timed per candidate, after one untimed
POINTER_ALIGNMENT = 256  # bytes: what cuBLASLt's heuristics assume of A, B and C unless told less

CUDA_R_32F, CUDA_R_16BF = 0, 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
MATMUL_DESC_TRANSA, MATMUL_DESC_TRANSB = 3, 4  # cublasLtMatmulDescAttributes_t
ALGO_CONFIG_SPLITK_NUM, ALGO_CONFIG_REDUCTION_SCHEME = 2, 3  # cublasLtMatmulAlgoConfigAttributes_t
ALGO_CAP_SPLITK_SUPPORT, ALGO_CAP_REDUCTION_SCHEME_MASK = 0, 1  # cublasLtMatmulAlgoCapAttributes_t
REDUCTION_SCHEME_COMPUTE_TYPE = 2  # cublasLtReductionScheme_t: partial sums in fp32 in the workspace
PREF_MAX_WORKSPACE_BYTES = 1  # cublasLtMatmulPreferenceAttributes_t


class MatmulAlgo(ctypes.Structure):
    """cublasLtMatmulAlgo_t: an opaque 64-byte value."""

    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t."""

    _fields_ = [("algo", MatmulAlgo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def tuning_wanted(value: str | None) -> bool:
    """The switch's value: "1" / "true" / "on" turn tuning on; unset or anything else leaves it off."""
    return (value or "").strip().lower() in ("1", "true", "on")


def split_k_counts(value: str | None) -> tuple[int, ...]:
    """OPENINFER_GEMM_SPLIT_K's split counts ("2,3,4"; unset or empty: none), each 2..MAX_SPLIT_K."""
    text = (value or "").strip()
    if not text:
        return ()
    try:
        counts = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 2 or max(counts) > MAX_SPLIT_K:
        raise ValueError(f"{SPLIT_K_ENV}={value!r}: expected comma-separated split counts in 2..{MAX_SPLIT_K}")
    return counts


def tuning_cache_path(value: str | None) -> Path | None:
    """OPENINFER_GEMM_TUNING_CACHE's file: unset or empty -> the default path, "off" / "0" -> None."""
    text = (value or "").strip()
    if text.lower() in ("off", "0", "false", "no"):
        return None
    return Path(text or DEFAULT_TUNING_CACHE).expanduser()


class TuningCache:
    """The kept algorithms on disk: ``{key: {"algo": hex of its 64 bytes, "split_k", "chosen",
    "candidates", "us", "first_pick_us"}}`` under one JSON object. Unreadable or malformed content counts as
    empty (logged), so a damaged file costs one tuning, never a failure; writes go through a
    temporary file renamed into place."""

    def __init__(self, path: Path | None):
        self.path = path
        self.entries: dict[str, dict[str, Any]] = {}
        if path is None or not path.is_file():
            return
        try:
            loaded = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            logger.warning("GEMM tuning cache %s unreadable (%s): tuning afresh", path, exc)
            return
        if not isinstance(loaded, dict):
            logger.warning("GEMM tuning cache %s is not a JSON object: tuning afresh", path)
            return
        self.entries = {key: entry for key, entry in loaded.items() if valid_entry(entry)}

    @staticmethod
    def key(device: str, lt_version: int, m: int, n: int, k: int, split_k: tuple[int, ...]) -> str:
        return f"{device}|cublasLt {lt_version}|{m}x{n}x{k}|split_k {','.join(map(str, split_k)) or '-'}"

    def get(self, key: str) -> dict[str, Any] | None:
        return self.entries.get(key)

    def put(self, key: str, entry: dict[str, Any]) -> None:
        """Keep ``entry`` and rewrite the file (a failed write is logged: the choice stays in memory)."""
        if not valid_entry(entry):
            raise ValueError(f"not a tuning cache entry: {entry!r}")
        self.entries[key] = entry
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, prefix=self.path.name, suffix=".tmp",
                                             delete=False) as handle:
                json.dump(self.entries, handle, indent=1, sort_keys=True)
            os.replace(handle.name, self.path)
        except OSError as exc:
            logger.warning("cannot write the GEMM tuning cache %s: %s", self.path, exc)


def valid_entry(entry: Any) -> bool:
    """Whether ``entry`` holds an algorithm (64 bytes in hex) and the numbers reported with it."""
    if not isinstance(entry, dict) or not isinstance(entry.get("algo"), str) or len(entry["algo"]) != 128:
        return False
    try:
        bytes.fromhex(entry["algo"])
    except ValueError:
        return False
    return all(isinstance(entry.get(name), int) for name in ("split_k", "chosen", "candidates")) and all(
        isinstance(entry.get(name), (int, float)) for name in ("us", "first_pick_us"))


def tunable(rows: int, max_rows: int = TUNED_MAX_ROWS) -> bool:
    """Whether a GEMM of ``rows`` rows takes the tuned path (decode-sized: 1..max_rows; larger
    ones gemmEx; ``linear`` gives a lone row to the skinny GEMV before it gets here)."""
    return 1 <= rows <= max_rows


def fastest(timings: dict[int, float]) -> int | None:
    """The candidate index with the smallest time (the lowest index among equals), None if none ran."""
    if not timings:
        return None
    return min(timings, key=lambda index: (timings[index], index))


@dataclass
class _Shape:
    """A tuned (M, N, K): its layouts and chosen algorithm (None: cuBLASLt had none, use gemmEx)."""

    layouts: tuple[ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    algo: MatmulAlgo | None
    candidates: int = 0  # how many heuristic candidates ran
    chosen: int = -1  # the kept one's rank in cuBLASLt's heuristic order (0: its own first pick; past its count: a split-K copy)
    microseconds: float = 0.0  # the kept one's time
    first_pick_microseconds: float = 0.0  # the heuristic's first pick's time (what tuning saves)
    split_k: int = 1  # the kept algorithm's split count when it is one of the split-K copies, else 1


def _load_lt() -> ctypes.CDLL:
    errors = []
    for name in ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"):
        try:
            return ctypes.CDLL(name)
        except OSError as exc:
            errors.append(str(exc))
    try:  # the nvidia wheels' copy, as for libcublas
        from cuda.pathfinder import load_nvidia_dynamic_lib

        return ctypes.CDLL(load_nvidia_dynamic_lib("cublasLt").abs_path)
    except Exception as exc:  # noqa: BLE001
        raise OSError("; ".join([*errors, str(exc)])) from exc


class LtTunedGemm:
    """One cuBLASLt handle, one matmul descriptor (bf16 in/out, fp32 compute, A transposed) and
    the tuned shapes, sharing ``Cublas``'s workspace (callers hold its lock)."""

    def __init__(self, lib: ctypes.CDLL, workspace: cupy.ndarray, max_rows: int = TUNED_MAX_ROWS,
                 split_k: tuple[int, ...] = (), cache: TuningCache | None = None):
        self.lib = lib
        self.workspace = workspace
        self.max_rows = max_rows
        self.split_k = split_k
        self.cache = cache if cache is not None else TuningCache(None)
        self.cached_shapes = 0  # shapes taken from the cache without timing
        self.shapes: dict[tuple[int, int, int], _Shape] = {}
        self.tuning_seconds = 0.0  # host time spent timing candidates, all shapes
        import cupy

        self.side_stream = cupy.cuda.Stream(non_blocking=True)
        # written between timed launches so each reads its weights from HBM as in a real step (E1,
        # H200: picks timed L2-hot over 5 back-to-back launches made the batch-256 decode step
        # 13.85 -> 14.02 ms); allocated here, never inside a graph capture
        l2_bytes = int(cupy.cuda.Device().attributes.get("L2CacheSize", 64 << 20))
        self.l2_flush = cupy.empty(2 * l2_bytes, dtype=cupy.uint8)
        self._alpha = ctypes.c_float(1.0)
        self._beta = ctypes.c_float(0.0)
        lib.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                                                   ctypes.c_uint64, ctypes.c_int64]
        lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(HeuristicResult), ctypes.POINTER(ctypes.c_int)]
        lib.cublasLtMatmul.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.POINTER(MatmulAlgo), ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        lib.cublasLtMatmulAlgoCheck.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.POINTER(MatmulAlgo), ctypes.POINTER(HeuristicResult)]
        lib.cublasLtMatmulAlgoConfigSetAttribute.argtypes = [ctypes.POINTER(MatmulAlgo), ctypes.c_int, ctypes.c_void_p,
                                                             ctypes.c_size_t]
        lib.cublasLtMatmulAlgoCapGetAttribute.argtypes = [ctypes.POINTER(MatmulAlgo), ctypes.c_int, ctypes.c_void_p,
                                                          ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]
        self.handle = ctypes.c_void_p()
        self._check(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        lib.cublasLtGetVersion.restype = ctypes.c_size_t
        self.lt_version = int(lib.cublasLtGetVersion())
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        self.device = f"{name} sm{props['major']}{props['minor']}"
        self.desc = ctypes.c_void_p()
        self._check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), CUBLAS_COMPUTE_32F, CUDA_R_32F),
                    "cublasLtMatmulDescCreate")
        for attribute, value in ((MATMUL_DESC_TRANSA, CUBLAS_OP_T), (MATMUL_DESC_TRANSB, CUBLAS_OP_N)):
            op = ctypes.c_int32(value)
            self._check(lib.cublasLtMatmulDescSetAttribute(self.desc, attribute, ctypes.byref(op),
                                                           ctypes.c_size_t(4)), "cublasLtMatmulDescSetAttribute")
        self.preference = ctypes.c_void_p()
        self._check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(self.preference)), "cublasLtMatmulPreferenceCreate")
        size = ctypes.c_size_t(workspace.nbytes)
        self._check(lib.cublasLtMatmulPreferenceSetAttribute(self.preference, PREF_MAX_WORKSPACE_BYTES,
                                                             ctypes.byref(size), ctypes.c_size_t(8)),
                    "cublasLtMatmulPreferenceSetAttribute")

    @classmethod
    def create(cls, workspace: cupy.ndarray, max_rows: int = TUNED_MAX_ROWS,
               split_k: tuple[int, ...] | None = None, cache: TuningCache | None = None) -> LtTunedGemm | None:
        """The tuned path, or None (logged) when cuBLASLt cannot be loaded or set up. ``split_k``:
        split counts timed beside the heuristic candidates (None: OPENINFER_GEMM_SPLIT_K's);
        ``cache``: where kept choices persist (None: OPENINFER_GEMM_TUNING_CACHE's file)."""
        if split_k is None:
            split_k = split_k_counts(os.environ.get(SPLIT_K_ENV))
        if cache is None:
            cache = TuningCache(tuning_cache_path(os.environ.get(TUNING_CACHE_ENV)))
        try:
            return cls(_load_lt(), workspace, max_rows, split_k, cache)
        except (OSError, RuntimeError, AttributeError) as exc:
            logger.warning("%s=1 but cuBLASLt is unavailable (%s); GEMMs stay on cublasGemmEx", GEMM_TUNING_ENV, exc)
            return None

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed with cuBLAS status {status}")

    def _layout(self, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), CUDA_R_16BF, rows, cols, ld),
                    "cublasLtMatrixLayoutCreate")
        return layout

    def _flush_l2(self) -> None:
        """Overwrite twice the L2's size on the side stream (evicts the operands of the last launch)."""
        with self.side_stream:
            self.l2_flush.fill(1)

    def _launch(self, shape: _Shape, algo: MatmulAlgo, x: cupy.ndarray, weight: cupy.ndarray, out: cupy.ndarray,
                stream: int) -> int:
        a_layout, b_layout, c_layout = shape.layouts
        return self.lib.cublasLtMatmul(
            self.handle, self.desc, ctypes.byref(self._alpha), ctypes.c_void_p(weight.data.ptr), a_layout,
            ctypes.c_void_p(x.data.ptr), b_layout, ctypes.byref(self._beta), ctypes.c_void_p(out.data.ptr), c_layout,
            ctypes.c_void_p(out.data.ptr), c_layout, ctypes.byref(algo), ctypes.c_void_p(self.workspace.data.ptr),
            ctypes.c_size_t(self.workspace.nbytes), ctypes.c_void_p(stream))

    def matmul_nt(self, x: cupy.ndarray, weight: cupy.ndarray, out: cupy.ndarray) -> bool:
        """``out = x @ weight^T`` on the tuned path; False when the shape is not for it (the caller
        then runs gemmEx: rows past ``max_rows``, rows not 16-byte aligned, an operand not 256-byte
        aligned). Operands are C-contiguous bf16."""
        m, k = x.shape
        n = weight.shape[0]
        if not tunable(m, self.max_rows) or k % 8 or n % 8:
            return False
        if (x.data.ptr | weight.data.ptr | out.data.ptr) % POINTER_ALIGNMENT:
            return False  # the heuristics assume 256-byte aligned operands (cuBLASLt's default)
        key = (m, n, k)
        shape = self.shapes.get(key)
        if shape is None:
            began = time.perf_counter()
            cache_key = TuningCache.key(self.device, self.lt_version, m, n, k, self.split_k)
            shape = self._from_cache(m, n, k, self.cache.get(cache_key))
            if shape is None:
                shape = self._tune(x, weight, out)
                if shape.algo is not None:
                    self.cache.put(cache_key, {"algo": bytes(shape.algo).hex(), "split_k": shape.split_k,
                                               "chosen": shape.chosen, "candidates": shape.candidates,
                                               "us": shape.microseconds,
                                               "first_pick_us": shape.first_pick_microseconds})
            else:
                self.cached_shapes += 1
            self.shapes[key] = shape
            self.tuning_seconds += time.perf_counter() - began
        if shape.algo is None:
            return False
        import cupy

        stream = cupy.cuda.get_current_stream()
        self._check(self._launch(shape, shape.algo, x, weight, out, stream.ptr), "cublasLtMatmul")
        return True

    def _layouts(self, m: int, n: int, k: int) -> tuple[ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]:
        return self._layout(k, n, k), self._layout(k, m, k), self._layout(n, m, n)

    def _from_cache(self, m: int, n: int, k: int, entry: dict[str, Any] | None) -> _Shape | None:
        """The shape with a cached algorithm cuBLASLt still accepts here (None: time it)."""
        if entry is None:
            return None
        algo = MatmulAlgo.from_buffer_copy(bytes.fromhex(entry["algo"]))
        shape = _Shape(self._layouts(m, n, k), None)
        a_layout, b_layout, c_layout = shape.layouts
        checked = HeuristicResult()
        if self.lib.cublasLtMatmulAlgoCheck(self.handle, self.desc, a_layout, b_layout, c_layout, c_layout,
                                            ctypes.byref(algo), ctypes.byref(checked)) != 0 \
                or checked.state != 0 or checked.workspace_size > self.workspace.nbytes:
            logger.info("cached cuBLASLt algorithm for %dx%dx%d refused here: timing afresh", m, n, k)
            return None
        shape.algo, shape.split_k, shape.chosen = algo, entry["split_k"], entry["chosen"]
        shape.candidates = entry["candidates"]
        shape.microseconds, shape.first_pick_microseconds = float(entry["us"]), float(entry["first_pick_us"])
        return shape

    def _split_copies(self, shape: _Shape, algo: MatmulAlgo) -> list[tuple[MatmulAlgo, int]]:
        """Copies of ``algo`` with each of ``split_k``'s counts (fp32 reduction in the workspace)
        that cuBLASLt accepts for this shape within the workspace; none if it has no split-K."""
        supported = ctypes.c_int32(0)
        written = ctypes.c_size_t(0)
        if self.lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), ALGO_CAP_SPLITK_SUPPORT,
                                                      ctypes.byref(supported), ctypes.c_size_t(4),
                                                      ctypes.byref(written)) != 0 or not supported.value:
            return []
        schemes = ctypes.c_uint32(0)
        if self.lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), ALGO_CAP_REDUCTION_SCHEME_MASK,
                                                      ctypes.byref(schemes), ctypes.c_size_t(4),
                                                      ctypes.byref(written)) != 0 \
                or not schemes.value & REDUCTION_SCHEME_COMPUTE_TYPE:
            return []
        a_layout, b_layout, c_layout = shape.layouts
        copies = []
        for count in self.split_k:
            copy = MatmulAlgo()
            ctypes.memmove(ctypes.byref(copy), ctypes.byref(algo), ctypes.sizeof(MatmulAlgo))
            splits, scheme = ctypes.c_uint32(count), ctypes.c_uint32(REDUCTION_SCHEME_COMPUTE_TYPE)
            if self.lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(copy), ALGO_CONFIG_SPLITK_NUM,
                                                             ctypes.byref(splits), ctypes.c_size_t(4)) != 0:
                continue
            if self.lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(copy), ALGO_CONFIG_REDUCTION_SCHEME,
                                                             ctypes.byref(scheme), ctypes.c_size_t(4)) != 0:
                continue
            checked = HeuristicResult()
            if self.lib.cublasLtMatmulAlgoCheck(self.handle, self.desc, a_layout, b_layout, c_layout, c_layout,
                                                ctypes.byref(copy), ctypes.byref(checked)) != 0:
                continue
            if checked.state == 0 and checked.workspace_size <= self.workspace.nbytes:
                copies.append((copy, count))
        return copies

    def _tune(self, x: cupy.ndarray, weight: cupy.ndarray, out: cupy.ndarray) -> _Shape:
        """Time the heuristic candidates for ``x``'s shape on the side stream; keep the fastest."""
        m, k = x.shape
        n = weight.shape[0]
        shape = _Shape(self._layouts(m, n, k), None)
        results = (HeuristicResult * CANDIDATES)()
        found = ctypes.c_int(0)
        a_layout, b_layout, c_layout = shape.layouts
        status = self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, a_layout, b_layout, c_layout,
                                                         c_layout, self.preference, CANDIDATES, results,
                                                         ctypes.byref(found))
        if status != 0 or found.value == 0:
            logger.info("cuBLASLt has no algorithm for %dx%dx%d (status %d); gemmEx", m, n, k, status)
            return shape
        import cupy

        current = cupy.cuda.get_current_stream()
        if not current.is_capturing():
            current.synchronize()  # the side stream then times on a quiet device
        # the heuristic's candidates in its order (index = rank), then their split-K copies
        candidates: list[tuple[MatmulAlgo, int]] = []
        for index in range(found.value):
            candidate = results[index]
            usable = candidate.state == 0 and candidate.workspace_size <= self.workspace.nbytes
            candidates.append((candidate.algo, 1 if usable else 0))  # (algorithm, split count; 0: skip it)
        if self.split_k:
            candidates += [copy for algo, usable in list(candidates) if usable for copy in self._split_copies(shape, algo)]
        timings: dict[int, float] = {}
        events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(TIMING_REPEATS)]
        for index, (algo, splits) in enumerate(candidates):
            if not splits:
                continue
            if self._launch(shape, algo, x, weight, out, self.side_stream.ptr) != 0:
                continue  # refused at launch: not a candidate
            for start, end in events:  # each launch timed alone, behind an L2 flush (weights from HBM)
                self._flush_l2()
                start.record(self.side_stream)
                self._launch(shape, algo, x, weight, out, self.side_stream.ptr)
                end.record(self.side_stream)
            events[-1][1].synchronize()
            timings[index] = sum(cupy.cuda.get_elapsed_time(a, b) for a, b in events) * 1e3 / TIMING_REPEATS
        best = fastest(timings)
        if best is not None:
            chosen = MatmulAlgo()
            ctypes.memmove(ctypes.byref(chosen), ctypes.byref(candidates[best][0]), ctypes.sizeof(MatmulAlgo))
            shape.algo, shape.candidates, shape.chosen, shape.microseconds = chosen, len(timings), best, timings[best]
            shape.split_k = candidates[best][1] if best >= found.value else 1
            shape.first_pick_microseconds = timings.get(0, 0.0)
            logger.debug("cuBLASLt %dx%dx%d: candidate %d of %d, %.1f us (heuristic first: %.1f us)", m, n, k, best,
                         len(timings), timings[best], timings.get(0, float("nan")))
        return shape

    def report(self) -> list[dict]:
        """Per tuned shape: rows, N, K, how many candidates ran, the kept one's heuristic rank and
        microseconds, and the heuristic's first pick's microseconds."""
        return [{"m": m, "n": n, "k": k, "tuned": s.algo is not None, "candidates": s.candidates, "chosen": s.chosen,
                 "split_k": s.split_k, "us": s.microseconds, "first_pick_us": s.first_pick_microseconds}
                for (m, n, k), s in sorted(self.shapes.items())]
