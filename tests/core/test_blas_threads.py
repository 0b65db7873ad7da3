"""The NumPy backend's BLAS thread switch: one thread for skinny GEMMs, the default for large ones."""

from __future__ import annotations

import numpy as np
import pytest

from openinfer.backend import NumpyBackend
from openinfer.backend.blas_threads import BlasThreads


def test_for_rows_switches_between_one_and_the_default() -> None:
    threads = BlasThreads()
    if not threads.available:
        pytest.skip("NumPy is not linked against OpenBLAS here")
    threads.for_rows(1, single_thread_max_rows=64)
    assert threads.current == 1
    threads.for_rows(65, single_thread_max_rows=64)
    assert threads.current == threads.default
    threads.use(threads.default)


def test_linear_results_do_not_depend_on_the_thread_choice() -> None:
    ops = NumpyBackend()
    rng = np.random.default_rng(0)
    weight = ops.linear_weight(rng.standard_normal((96, 80), dtype=np.float32),
                               rng.standard_normal(96, dtype=np.float32))
    x = rng.standard_normal((100, 80), dtype=np.float32)
    reference = x.astype(np.float64) @ weight.weight_t.astype(np.float64) + weight.bias
    np.testing.assert_allclose(ops.linear(x, weight), reference, rtol=1e-4, atol=1e-4)  # > 64 rows
    np.testing.assert_allclose(ops.linear(x[:3], weight), reference[:3], rtol=1e-4, atol=1e-4)
    if ops.blas_threads.available:
        assert ops.blas_threads.current == 1
