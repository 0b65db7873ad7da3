"""gemv_m1 with 2 or 4 columns a warp ($OPENINFER_GEMV_M1_COLS): the same bits as one column a warp on the device
(each column's lanes sum their k in the same order), at Kimi-K2's one-row projection shapes and at widths whose last
block has warps past the end, with and without a bias; and a clear error for another value."""

from __future__ import annotations

import numpy as np
import pytest

from openinfer.backend.numpy_backend import NumpyBackend
from tests.gpu.conftest import bf16_random, relative_error

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

REF = NumpyBackend()


# Kimi-K2: qkv_a (7168 -> 2112), q_b (1536 -> 12288), o_proj (8192 -> 7168); odd widths: a last tile part-filled
@pytest.mark.parametrize("k,n", [(7168, 2112), (1536, 12288), (8192, 7168), (1000, 61), (4352, 21)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_m1_columns_give_the_one_column_bits(cuda_backend, rng, monkeypatch, k, n, with_bias):
    from openinfer.backend.cuda import linear

    x = bf16_random(rng, 1, k)
    w = bf16_random(rng, n, k, scale=0.05)
    bias = bf16_random(rng, n) if with_bias else None
    layer = cuda_backend.linear_weight(w, bias)
    dx = cuda_backend.upload(x)
    outputs = {}
    for cols in ("1", "2", "4", "auto"):
        monkeypatch.setenv(linear.GEMV_M1_COLS_ENV, cols)
        outputs[cols] = cupy.asnumpy(cuda_backend.linear(dx, layer).view(cupy.uint16))
    assert np.array_equal(outputs["2"], outputs["1"])
    assert np.array_equal(outputs["4"], outputs["1"])
    assert np.array_equal(outputs["auto"], outputs["1"])
    want_cols = 2 if -(-n // linear.GEMV_WARPS_PER_BLOCK) > linear.GEMV_M1_BLOCKS_PER_SM * cuda_backend.num_sms else 1
    assert linear.gemv_m1_columns(n) == want_cols
    got = cuda_backend.to_host(cuda_backend.linear(dx, layer))
    want = REF.linear(x, REF.linear_weight(w, bias))
    assert relative_error(got, want) < 1e-2


def test_gemv_m1_columns_switch_rejects_other_values(cuda_backend, rng, monkeypatch):
    from openinfer.backend.cuda import linear

    layer = cuda_backend.linear_weight(bf16_random(rng, 16, 64), None)
    monkeypatch.setenv(linear.GEMV_M1_COLS_ENV, "3")
    with pytest.raises(ValueError, match="OPENINFER_GEMV_M1_COLS"):
        cuda_backend.linear(cuda_backend.upload(bf16_random(rng, 1, 64)), layer)


def test_gemv_beside_other_work_takes_at_least_the_beside_columns(cuda_backend, rng, monkeypatch):
    """Inside ``gemv_beside_other_work`` (the MoE side stream's shared experts) a one-row GEMV takes at least
    $OPENINFER_GEMV_M1_COLS_BESIDE columns a warp, outside as before; nested blocks unwind; the same bits."""
    from openinfer.backend.cuda import linear

    monkeypatch.setenv(linear.GEMV_M1_COLS_ENV, "auto")
    monkeypatch.setenv(linear.GEMV_M1_COLS_BESIDE_ENV, "2")
    assert linear.gemv_m1_columns(64) == 1
    with linear.gemv_beside_other_work():
        assert linear.gemv_m1_columns(64) == 2
        with linear.gemv_beside_other_work():
            assert linear.gemv_m1_columns(64) == 2
        assert linear.gemv_m1_columns(64) == 2
    assert linear.gemv_m1_columns(64) == 1
    monkeypatch.setenv(linear.GEMV_M1_COLS_ENV, "4")
    with linear.gemv_beside_other_work():
        assert linear.gemv_m1_columns(64) == 4  # at least, never fewer
    x, w = bf16_random(rng, 1, 7168), bf16_random(rng, 4096, 7168, scale=0.05)
    layer, dx = cuda_backend.linear_weight(w, None), cuda_backend.upload(x)
    monkeypatch.setenv(linear.GEMV_M1_COLS_ENV, "auto")
    plain = cupy.asnumpy(cuda_backend.linear(dx, layer).view(cupy.uint16))
    with linear.gemv_beside_other_work():
        beside = cupy.asnumpy(cuda_backend.linear(dx, layer).view(cupy.uint16))
    assert np.array_equal(beside, plain)
    monkeypatch.setenv(linear.GEMV_M1_COLS_BESIDE_ENV, "3")
    with linear.gemv_beside_other_work(), pytest.raises(ValueError, match="OPENINFER_GEMV_M1_COLS_BESIDE"):
        linear.gemv_m1_columns(64)
