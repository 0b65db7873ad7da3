"""core's ``kernels/elementwise.cu`` silu_mul kernels compiled with g++ against the host stand-in for
the CUDA built-ins (tests/helpers/cuda_host) and run on the CPU: the vectorised ``silu_mul_vec8``
(8 outputs per thread, 16-byte accesses) and ``silu_mul_rows`` (a (row, chunk) grid, two vectors
per thread) give exactly the bits of the one-element-per-thread ``silu_mul``, and both match the NumPy composition silu(gate) rounded to bf16, times up. The GPU
tests (tests/gpu/test_ops.py) check the backend op on the device."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from openinfer import float32_to_bf16
from tests.helpers.cuda_emulation import bf16, compile_harness, read_array, run_harness

REPO = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).parent / "cuda_emulation" / "elementwise_harness.cpp"


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    return compile_harness(HARNESS, REPO / "core" / "kernels", tmp_path_factory.mktemp("elementwise") / "harness")


# half 1032: 129 vectors, 3 chunks of 64 for silu_mul_rows, the last with one
@pytest.mark.parametrize("rows,half,blocks", [(1, 8, 1), (3, 40, 2), (17, 96, 3), (5, 1024, 4), (2, 1032, 3)])
def test_silu_mul_vec8_is_bit_identical_to_silu_mul(harness, tmp_path, rows, half, blocks):
    rng = np.random.default_rng(rows * half)
    gate_up = bf16(3.0 * rng.standard_normal((rows, 2 * half)))
    run_harness(harness, tmp_path, params=np.array([rows, half, blocks], np.int32), gate_up=float32_to_bf16(gate_up))
    scalar = np.fromfile(tmp_path / "scalar.bin", np.uint16).reshape(rows, half)
    vectorised = np.fromfile(tmp_path / "vectorised.bin", np.uint16).reshape(rows, half)
    assert np.array_equal(vectorised, scalar)
    by_rows = np.fromfile(tmp_path / "by_rows.bin", np.uint16).reshape(rows, half)
    assert np.array_equal(by_rows, scalar)
    gate, up = gate_up[:, :half], gate_up[:, half:]
    expected = bf16(bf16(gate / (1 + np.exp(-gate))) * up)
    ours = read_array(tmp_path, "vectorised", np.uint16, (rows, half))
    assert np.allclose(ours, expected, rtol=1e-2, atol=1e-6)
