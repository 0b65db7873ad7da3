"""core's ``kernels/gemv.cu`` fused decode GEMVs compiled with g++ against the host stand-in for the
CUDA built-ins (tests/helpers/cuda_host) and run on the CPU: at every grid size — one block per
column tile, a few blocks each looping over several tiles, one block looping over all — the fused
``gemv_m1_add_rms_norm`` and ``gemv_m1_silu_mul`` give exactly the bits of the unfused kernels
they replace (rms_norm.cu / elementwise.cu, then ``gemv_m1``), and those match the NumPy
composition. The GPU tests (tests/gpu/test_fused_decode.py) check the same on the device."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from openinfer import float32_to_bf16
from openinfer.backend.numpy_backend import NumpyBackend
from tests.helpers.cuda_emulation import bf16, compile_harness, read_array, run_harness

REPO = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).parent / "cuda_emulation" / "gemv_harness.cpp"
WARPS_PER_BLOCK = 8  # gemv.cu: a block's tile is 8 columns at M = 1


def norm_threads(features: int) -> int:
    """rms_norm.cu's block size, as the CUDA backend picks it (backend._norm_threads)."""
    return min(1024, max(32, -(-features // 32) * 32 // 2))


@pytest.fixture(scope="module", params=[0, 1], ids=["serial_tail", "batched_tail"])
def harness(request, tmp_path_factory) -> Path:
    """The harness with gemv.cu's last partial pass one load at a time (0) or all loads first (1)."""
    return compile_harness(HARNESS, REPO / "core" / "kernels", tmp_path_factory.mktemp("gemv") / "harness",
                           {"GEMV_BATCHED_TAIL": request.param})


@pytest.mark.parametrize("k,n", [(256, 200), (1000, 61), (2824, 24)])  # 2824: a whole pass, then a partial one
@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_gemvs_equal_unfused_bits_at_every_grid(harness, tmp_path, k, n, with_residual):
    rng = np.random.default_rng(k + n + with_residual)
    x, residual = bf16(rng.standard_normal(k)), bf16(rng.standard_normal(k))
    norm = bf16(1 + 0.3 * rng.standard_normal(k))
    gate_up = bf16(3.0 * rng.standard_normal(2 * k))
    w = bf16(0.05 * rng.standard_normal((n, k)))
    tiles = -(-n // WARPS_PER_BLOCK)
    grids = [tiles, 3, 1]
    run_harness(harness, tmp_path, params=np.array([k, n, norm_threads(k), int(with_residual), *grids], np.int32),
                x=float32_to_bf16(x), residual=float32_to_bf16(residual), norm=float32_to_bf16(norm),
                gate_up=float32_to_bf16(gate_up), w=float32_to_bf16(w))

    def bits(name: str, size: int) -> np.ndarray:
        return np.fromfile(tmp_path / f"{name}.bin", np.uint16)[:size]

    for g in range(len(grids)):
        assert np.array_equal(bits(f"fused_norm_{g}", n), bits("unfused_norm", n)), f"grid {grids[g]}"
        assert np.array_equal(bits(f"fused_residual_{g}", k), bits("unfused_residual", k)), f"grid {grids[g]}"
        assert np.array_equal(bits(f"fused_silu_{g}", n), bits("unfused_silu", n)), f"grid {grids[g]}"
    ref = NumpyBackend()
    h = bf16(x + residual) if with_residual else x
    expected_norm = ref.linear(bf16(ref.rms_norm(h[None], norm, 1e-6)), ref.linear_weight(w, None))[0]
    gate, up = gate_up[:k], gate_up[k:]
    expected_silu = ref.linear(bf16(bf16(gate / (1 + np.exp(-gate))) * up)[None], ref.linear_weight(w, None))[0]
    assert np.allclose(read_array(tmp_path, "fused_norm_2", np.uint16, (n,)), expected_norm, rtol=2e-2, atol=2e-2)
    assert np.allclose(read_array(tmp_path, "fused_silu_2", np.uint16, (n,)), expected_silu, rtol=2e-2, atol=2e-2)


# 128: lanes 16-31 past the row's end; 1536: Kimi-K2's q_b row (one rms_scaled pass); 4352: two gemv_m1 passes + a step
@pytest.mark.parametrize("k,n", [(128, 40), (1000, 61), (1536, 24), (4352, 16)])
def test_one_row_gemvs_match_numpy(harness, tmp_path, k, n):
    """gemv_m1 (x @ w) and gemv_m1_rms_scaled (rms_norm(x) @ w, fp32 throughout) within bf16 rounding of NumPy."""
    rng = np.random.default_rng(k + n)
    x, norm = bf16(rng.standard_normal(k)), bf16(1 + 0.3 * rng.standard_normal(k))
    w = bf16(0.05 * rng.standard_normal((n, k)))
    run_harness(harness, tmp_path, params=np.array([k, n, norm_threads(k), 0, 1, 1, 1], np.int32),
                x=float32_to_bf16(x), residual=float32_to_bf16(x), norm=float32_to_bf16(norm),
                gate_up=float32_to_bf16(np.concatenate([x, x])), w=float32_to_bf16(w))
    ref = NumpyBackend()
    got = read_array(tmp_path, "gemv_m1", np.uint16, (n,))
    assert np.allclose(got, ref.linear(x[None], ref.linear_weight(w, None))[0], rtol=2e-2, atol=2e-2)
    scaled = read_array(tmp_path, "rms_scaled", np.uint16, (n,))
    want = (x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + 1e-6) * norm) @ w.T
    assert np.allclose(scaled, want, rtol=2e-2, atol=2e-2)


@pytest.fixture(scope="module")
def harness_by_columns(tmp_path_factory) -> dict[int, Path]:
    """The harness with gemv_m1's warps owning 1, 2 or 4 columns (core's $OPENINFER_GEMV_M1_COLS)."""
    return {cols: compile_harness(HARNESS, REPO / "core" / "kernels", tmp_path_factory.mktemp(f"gemv_cols{cols}") /
                                  "harness", {"GEMV_M1_COLS": cols}) for cols in (1, 2, 4)}


# 61 / 21: a last tile whose warps own columns past N; 1536: Kimi-K2's q_b row (less than a pass of 8 steps, more
# than one of 4); 4352: two 8-step passes and a step; 7168: Kimi-K2's qkv_a / shared-expert row
@pytest.mark.parametrize("k,n", [(128, 40), (1000, 61), (1536, 24), (4352, 21), (7168, 48)])
def test_gemv_m1_columns_a_warp_give_the_same_bits(harness_by_columns, tmp_path, k, n):
    """gemv_m1 with 2 or 4 columns a warp (a narrower grid, shorter passes) gives the 1-column build's bits (each
    column's lanes sum their k in the same order), and those match NumPy."""
    rng = np.random.default_rng(k * n)
    x = bf16(rng.standard_normal(k))
    w = bf16(0.05 * rng.standard_normal((n, k)))
    outputs = {}
    for cols, binary in harness_by_columns.items():
        folder = tmp_path / f"cols{cols}"
        folder.mkdir()
        run_harness(binary, folder, params=np.array([k, n, norm_threads(k), 0, 1, 1, 1], np.int32),
                    x=float32_to_bf16(x), residual=float32_to_bf16(x), norm=float32_to_bf16(np.ones(k, np.float32)),
                    gate_up=float32_to_bf16(np.concatenate([x, x])), w=float32_to_bf16(w))
        outputs[cols] = np.fromfile(folder / "gemv_m1.bin", np.uint16)[:n]
    assert np.array_equal(outputs[2], outputs[1])
    assert np.array_equal(outputs[4], outputs[1])
    ref = NumpyBackend()
    got = read_array(tmp_path / "cols2", "gemv_m1", np.uint16, (n,))
    assert np.allclose(got, ref.linear(x[None], ref.linear_weight(w, None))[0], rtol=2e-2, atol=2e-2)
