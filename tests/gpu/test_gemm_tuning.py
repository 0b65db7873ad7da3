"""cuBLASLt GEMMs with a timed algorithm (OPENINFER_GEMM_TUNING=1) against NumPy and gemmEx,
eager and inside a CUDA graph capture (a shape first seen while capturing is timed on the side
stream; the graph then replays the same bits as an eager call)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from openinfer.backend.cuda.bf16 import bf16_bits_to_float, float_to_bf16_bits
from tests.gpu.conftest import bf16_random, relative_error

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def blas_pair():
    from openinfer.backend import cuda_available

    if not cuda_available():
        pytest.skip("needs CuPy and an NVIDIA GPU")
    from openinfer.backend.cuda.cublas import Cublas
    from openinfer.backend.cuda.gemm_tuning import LtTunedGemm, TuningCache

    plain = Cublas()
    plain.tuned = None
    tuned = Cublas()
    tuned.tuned = LtTunedGemm.create(tuned.workspace, cache=TuningCache(None))  # timed here, not from disk
    if tuned.tuned is None:
        pytest.fail("cuBLASLt could not be loaded next to cuBLAS")
    return plain, tuned


def _operands(rng, m, n, k):
    x = bf16_random(rng, m, k)
    w = bf16_random(rng, n, k, scale=1 / np.sqrt(k))
    return x, w, cupy.asarray(float_to_bf16_bits(x)), cupy.asarray(float_to_bf16_bits(w))


@pytest.mark.parametrize(("m", "n", "k"), [(2, 256, 512), (48, 2560, 4096), (256, 2560, 9728), (256, 6144, 2560),
                                           (96, 1000, 2048)])
def test_tuned_gemm_matches_numpy_and_gemm_ex(blas_pair, rng, m, n, k):
    plain, tuned = blas_pair
    x, w, xd, wd = _operands(rng, m, n, k)
    ours = cupy.empty((m, n), dtype=cupy.uint16)
    reference = cupy.empty((m, n), dtype=cupy.uint16)
    tuned.matmul_nt(xd, wd, ours)
    plain.matmul_nt(xd, wd, reference)
    shape = tuned.tuned.shapes[(m, n, k)]
    assert shape.algo is not None and shape.candidates >= 1 and shape.microseconds > 0
    expected = x.astype(np.float64) @ w.astype(np.float64).T
    assert relative_error(bf16_bits_to_float(ours.get()), expected) < 1e-2
    # the same sums up to summation order: within a few bf16 roundings of gemmEx
    assert relative_error(bf16_bits_to_float(ours.get()), bf16_bits_to_float(reference.get())) < 1e-2
    again = cupy.empty_like(ours)
    tuned.matmul_nt(xd, wd, again)  # the kept algorithm: the same bits every call
    assert cupy.array_equal(again, ours)


def test_rows_past_the_limit_stay_on_gemm_ex(blas_pair, rng):
    plain, tuned = blas_pair
    from openinfer.backend.cuda.gemm_tuning import TUNED_MAX_ROWS

    m = TUNED_MAX_ROWS + 8
    _, _, xd, wd = _operands(rng, m, 512, 256)
    ours, reference = cupy.empty((m, 512), dtype=cupy.uint16), cupy.empty((m, 512), dtype=cupy.uint16)
    tuned.matmul_nt(xd, wd, ours)
    plain.matmul_nt(xd, wd, reference)
    assert (m, 512, 256) not in tuned.tuned.shapes
    assert cupy.array_equal(ours, reference)


def test_shape_first_seen_inside_a_graph_capture(blas_pair, rng):
    _, tuned = blas_pair
    m, n, k = 64, 1536, 2560
    x, w, xd, wd = _operands(rng, m, n, k)
    assert (m, n, k) not in tuned.tuned.shapes
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        out = cupy.zeros((m, n), dtype=cupy.uint16)
        stream.synchronize()
        stream.begin_capture(cupy.cuda.runtime.streamCaptureModeRelaxed)
        try:
            tuned.matmul_nt(xd, wd, out)
        finally:
            graph = stream.end_capture()
        out.fill(0)
        graph.launch()
        stream.synchronize()
    assert tuned.tuned.shapes[(m, n, k)].algo is not None
    eager = cupy.empty_like(out)
    tuned.matmul_nt(xd, wd, eager)
    cupy.cuda.get_current_stream().synchronize()
    assert cupy.array_equal(out, eager)
    expected = x.astype(np.float64) @ w.astype(np.float64).T
    assert relative_error(bf16_bits_to_float(out.get()), expected) < 1e-2


def test_backend_linear_under_the_switch(monkeypatch, rng):
    from openinfer.backend import cuda_available

    if not cuda_available():
        pytest.skip("needs CuPy and an NVIDIA GPU")
    monkeypatch.setenv("OPENINFER_GEMM_TUNING", "1")
    from openinfer.backend.cuda import CudaBackend

    backend = CudaBackend()
    assert backend.blas.tuned is not None
    x, w = bf16_random(rng, 32, 512), bf16_random(rng, 768, 512, scale=0.05)
    out = backend.to_host(backend.linear(backend.upload(x), backend.linear_weight(w)))
    assert (32, 768, 512) in backend.blas.tuned.shapes
    assert relative_error(out, x.astype(np.float64) @ w.astype(np.float64).T) < 1e-2
    assert backend.blas.tuned.tuning_seconds > 0
    backend.set_gemm_row_buckets([32])  # logs the tuning summary (after graph capture in the engine)
    assert backend.gemm_row_buckets == (32,)


def test_operand_off_the_256_byte_alignment_stays_on_gemm_ex(blas_pair, rng):
    plain, tuned = blas_pair
    m, n, k = 32, 256, 520  # a row of 1040 bytes: the second row starts off the 256-byte grid
    x = cupy.asarray(float_to_bf16_bits(bf16_random(rng, m + 1, k)))[1:]
    _, _, _, wd = _operands(rng, m, n, k)
    assert x.data.ptr % 256 and x.flags.c_contiguous
    ours, reference = cupy.empty((m, n), dtype=cupy.uint16), cupy.empty((m, n), dtype=cupy.uint16)
    tuned.matmul_nt(x, wd, ours)
    plain.matmul_nt(x, wd, reference)
    assert (m, n, k) not in tuned.tuned.shapes
    assert cupy.array_equal(ours, reference)


@pytest.mark.parametrize(("m", "n", "k"), [(256, 2560, 9728), (224, 2560, 4096), (64, 6144, 2560)])
def test_split_k_copies_match_numpy_and_gemm_ex(blas_pair, rng, m, n, k):
    """OPENINFER_GEMM_SPLIT_K: the heuristic candidates' split-K copies (fp32 reduction) are timed
    beside them; whichever is kept gives numpy's product within bf16 rounding, the same bits on
    every call, and reports its split count."""
    from openinfer.backend.cuda.cublas import Cublas
    from openinfer.backend.cuda.gemm_tuning import LtTunedGemm, TuningCache

    plain, _ = blas_pair
    split = Cublas()
    split.tuned = LtTunedGemm.create(split.workspace, split_k=(2, 3, 4), cache=TuningCache(None))
    x, w, xd, wd = _operands(rng, m, n, k)
    ours = cupy.empty((m, n), dtype=cupy.uint16)
    reference = cupy.empty((m, n), dtype=cupy.uint16)
    split.matmul_nt(xd, wd, ours)
    plain.matmul_nt(xd, wd, reference)
    shape = split.tuned.shapes[(m, n, k)]
    assert shape.algo is not None and shape.split_k in (1, 2, 3, 4)
    assert shape.candidates >= 1 and shape.microseconds > 0
    expected = x.astype(np.float64) @ w.astype(np.float64).T
    assert relative_error(bf16_bits_to_float(ours.get()), expected) < 1e-2
    assert relative_error(bf16_bits_to_float(ours.get()), bf16_bits_to_float(reference.get())) < 1e-2
    again = cupy.empty_like(ours)
    split.matmul_nt(xd, wd, again)
    assert cupy.array_equal(again, ours)
    (row,) = [r for r in split.tuned.report() if (r["m"], r["n"], r["k"]) == (m, n, k)]
    assert row["split_k"] == shape.split_k


def test_a_second_process_takes_the_kept_algorithms_from_the_disk_cache(rng, tmp_path):
    """OPENINFER_GEMM_TUNING_CACHE: the first tuner times the shape and writes its pick; a second
    one over the same file launches that pick untimed (the same bits); a damaged file is timed afresh."""
    from openinfer.backend.cuda.cublas import Cublas
    from openinfer.backend.cuda.gemm_tuning import LtTunedGemm, TuningCache

    path = tmp_path / "tuning.json"
    m, n, k = 192, 2560, 4096
    x, w, xd, wd = _operands(rng, m, n, k)
    outputs = []
    for run in range(2):
        blas = Cublas()
        blas.tuned = LtTunedGemm.create(blas.workspace, split_k=(2,), cache=TuningCache(path))
        out = cupy.empty((m, n), dtype=cupy.uint16)
        blas.matmul_nt(xd, wd, out)
        outputs.append(out)
        assert blas.tuned.cached_shapes == run  # timed the first time, from the file the second
        assert blas.tuned.shapes[(m, n, k)].algo is not None
    assert path.is_file() and len(json.loads(path.read_text())) == 1
    assert cupy.array_equal(outputs[0], outputs[1])
    expected = x.astype(np.float64) @ w.astype(np.float64).T
    assert relative_error(bf16_bits_to_float(outputs[1].get()), expected) < 1e-2
    path.write_text("{not json")
    blas = Cublas()
    blas.tuned = LtTunedGemm.create(blas.workspace, split_k=(2,), cache=TuningCache(path))
    out = cupy.empty((m, n), dtype=cupy.uint16)
    blas.matmul_nt(xd, wd, out)
    assert blas.tuned.cached_shapes == 0 and len(json.loads(path.read_text())) == 1


def test_row_buckets_load_every_seen_weight_shape(rng):
    """``set_gemm_row_buckets`` runs one GEMM per (bucket past the GEMV rows, weight shape the
    backend has seen), so an eager GEMM padded to a bucket no capture ran with that weight (an LM
    head padded to a short-prefill graph's token count) finds its kernel loaded; results unchanged."""
    from openinfer.backend.cuda import CudaBackend

    backend = CudaBackend()
    w1, w2 = bf16_random(rng, 96, 64, scale=0.125), bf16_random(rng, 40, 128, scale=0.1)
    layer1, layer2 = backend.linear_weight(w1), backend.linear_weight(w2)
    backend.linear(cupy.asarray(float_to_bf16_bits(bf16_random(rng, 3, 64))), layer1)
    backend.linear(cupy.asarray(float_to_bf16_bits(bf16_random(rng, 5, 128))), layer2)
    backend.linear(cupy.asarray(float_to_bf16_bits(bf16_random(rng, 7, 64))), layer1)  # the same shape again
    backend.set_gemm_row_buckets([1, 16, 40])
    assert backend.gemm_warmups == 2 * 2  # buckets 16 and 40 (1 row is the GEMV's) x two weight shapes
    x = bf16_random(rng, 30, 64)
    out = backend.to_host(backend.linear(cupy.asarray(float_to_bf16_bits(x)), layer1))
    assert out.shape == (30, 96)
    assert relative_error(out, x.astype(np.float64) @ w1.astype(np.float64).T) < 1e-2
