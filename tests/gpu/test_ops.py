"""Every cuda op against its NumPy op on random bf16-representable inputs."""

from __future__ import annotations

import numpy as np
import pytest

from openinfer.backend.cuda.bf16 import round_to_bf16
from openinfer.backend.numpy_backend import NumpyBackend
from tests.gpu.conftest import bf16_random, relative_error

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

REF = NumpyBackend()
BF16_TOL = 1e-2


def test_upload_to_host_round_trip(cuda_backend, rng):
    x = bf16_random(rng, 33, 70)
    assert np.array_equal(cuda_backend.to_host(cuda_backend.upload(x)), x)


@pytest.mark.parametrize("features", [64, 2560, 1000])
def test_rms_norm(cuda_backend, rng, features):
    x, w = bf16_random(rng, 37, features), 1 + bf16_random(rng, features, scale=0.3)
    w = round_to_bf16(w)
    out = cuda_backend.to_host(cuda_backend.rms_norm(cuda_backend.upload(x), cuda_backend.weight(w), 1e-6))
    assert relative_error(out, REF.rms_norm(x, w, 1e-6)) < BF16_TOL


def test_add_rms_norm(cuda_backend, rng):
    x, r, w = bf16_random(rng, 19, 512), bf16_random(rng, 19, 512), round_to_bf16(1 + bf16_random(rng, 512, scale=0.3))
    out, residual = cuda_backend.add_rms_norm(cuda_backend.upload(x), cuda_backend.upload(r), cuda_backend.weight(w), 1e-5)
    assert np.array_equal(cuda_backend.to_host(residual), round_to_bf16(x + r))
    ref_out, _ = REF.add_rms_norm(round_to_bf16(x + r), np.zeros_like(x), w, 1e-5)
    assert relative_error(cuda_backend.to_host(out), ref_out) < BF16_TOL


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_linear(cuda_backend, rng, rows, bias):
    k, n = 1024, 768
    x, w = bf16_random(rng, rows, k), bf16_random(rng, n, k, scale=0.05)
    b = bf16_random(rng, n) if bias else None
    layer = cuda_backend.linear_weight(w, b)
    out = cuda_backend.to_host(cuda_backend.linear(cuda_backend.upload(x), layer))
    assert relative_error(out, REF.linear(x, REF.linear_weight(w, b))) < BF16_TOL


@pytest.mark.parametrize("rows", [2, 3, 9, 17, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_padded_to_row_buckets(cuda_backend, rng, rows, bias):
    """Rows padded up to a bucket (a kernel graph capture loaded): same [rows, n] result."""
    from openinfer.backend.cuda.linear import linear

    k, n = 1024, 768
    x, w = bf16_random(rng, rows, k), bf16_random(rng, n, k, scale=0.05)
    b = bf16_random(rng, n) if bias else None
    layer = cuda_backend.linear_weight(w, b)
    out = linear(cuda_backend.upload(x), layer, cuda_backend.blas, row_buckets=(1, 4, 16, 24, 64))
    assert out.shape == (rows, n) and out.flags.c_contiguous
    assert relative_error(cuda_backend.to_host(out), REF.linear(x, REF.linear_weight(w, b))) < BF16_TOL


def test_linear_odd_in_features_uses_cublas(cuda_backend, rng):
    x, w = bf16_random(rng, 4, 100), bf16_random(rng, 48, 100)
    out = cuda_backend.to_host(cuda_backend.linear(cuda_backend.upload(x), cuda_backend.linear_weight(w)))
    assert relative_error(out, x @ w.T) < BF16_TOL


@pytest.mark.parametrize("bias", [False, True])
def test_skinny_gemm_matches_numpy_and_is_batch_invariant(cuda_backend, rng, bias):
    from openinfer.backend.cuda.linear import skinny_gemm

    x, w = bf16_random(rng, 8, 2560 + 8), bf16_random(rng, 517, 2560 + 8, scale=0.05)
    b = bf16_random(rng, 517) if bias else None
    layer = cuda_backend.linear_weight(w, b)

    def run(m):
        out = cupy.empty((m, 517), dtype=cupy.uint16)
        skinny_gemm(cuda_backend.upload(x[:m]), layer, out)
        return cuda_backend.to_host(out)

    full = run(8)
    assert relative_error(full, REF.linear(x, REF.linear_weight(w, b))) < BF16_TOL
    for m in (1, 2, 3, 4, 7):
        assert np.array_equal(run(m), full[:m])


def test_silu_mul_add_gather(cuda_backend, rng):
    gate_up = bf16_random(rng, 21, 2 * 384, scale=2.0)
    out = cuda_backend.to_host(cuda_backend.silu_mul(cuda_backend.upload(gate_up)))
    assert relative_error(out, REF.silu_mul(gate_up)) < BF16_TOL
    a, b = bf16_random(rng, 5, 96), bf16_random(rng, 5, 96)
    assert np.array_equal(cuda_backend.to_host(cuda_backend.add(cuda_backend.upload(a), cuda_backend.upload(b))),
                          round_to_bf16(a + b))
    table = bf16_random(rng, 50, 72)
    ids = rng.integers(0, 50, size=13).astype(np.int32)
    assert np.array_equal(cuda_backend.to_host(cuda_backend.embedding(cuda_backend.weight(table), cupy.asarray(ids))),
                          table[ids])
    assert np.array_equal(cuda_backend.to_host(cuda_backend.gather_rows(cuda_backend.upload(table), ids)), table[ids])


@pytest.mark.parametrize("rows,half", [(1, 9728), (21, 384), (3, 100), (7, 12)])
def test_silu_mul_kernels_give_the_same_bits(cuda_backend, rng, rows, half):
    """The 8-wide kernel (half % 8 == 0) and the one-element kernel agree bit for bit."""
    from openinfer.backend.cuda.loader import kernel

    gate_up = cuda_backend.upload(bf16_random(rng, rows, 2 * half, scale=3.0))
    out = cuda_backend.silu_mul(gate_up)
    scalar = cupy.empty_like(out)
    kernel("elementwise.cu", "silu_mul")((64,), (256,), (gate_up, scalar, np.int64(rows), np.int32(half)))
    assert np.array_equal(cuda_backend.to_host(out), cuda_backend.to_host(scalar))
    assert relative_error(cuda_backend.to_host(out), REF.silu_mul(cuda_backend.to_host(gate_up))) < BF16_TOL


def test_large_float32_weight_is_narrowed_on_the_gpu(cuda_backend, rng):
    w = rng.standard_normal((300, 301)).astype(np.float32)  # not bf16-representable: rounding matters
    assert np.array_equal(cuda_backend.to_host(cuda_backend.weight(w)), round_to_bf16(w))
