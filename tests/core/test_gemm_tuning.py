"""The cuBLASLt tuning switch's host-side rules (no GPU): which values turn it on, which GEMMs
take it, which timed candidate wins, and the ctypes layouts of cuBLASLt's structs."""

from __future__ import annotations

import ctypes

import pytest

from openinfer.backend.cuda.gemm_tuning import (
    MAX_SPLIT_K,
    SPLIT_K_ENV,
    TUNED_MAX_ROWS,
    HeuristicResult,
    MatmulAlgo,
    fastest,
    split_k_counts,
    tunable,
    tuning_wanted,
)


@pytest.mark.parametrize(("value", "wanted"), [("1", True), ("true", True), (" ON ", True), ("0", False),
                                               ("", False), (None, False), ("yes please", False)])
def test_tuning_wanted(value, wanted):
    assert tuning_wanted(value) is wanted


def test_tunable_rows():
    assert tunable(1) and tunable(TUNED_MAX_ROWS)
    assert not tunable(0) and not tunable(TUNED_MAX_ROWS + 1)
    assert tunable(512, max_rows=512) and not tunable(513, max_rows=512)


def test_fastest_takes_the_smallest_time_and_the_lowest_index_of_equals():
    assert fastest({}) is None
    assert fastest({0: 12.0, 3: 9.5, 5: 11.0}) == 3
    assert fastest({4: 7.0, 2: 7.0, 6: 8.0}) == 2


def test_struct_sizes_match_the_c_api():
    # cublasLtMatmulAlgo_t is uint64_t[8]; the heuristic result adds size_t, status, float, int[4]
    assert ctypes.sizeof(MatmulAlgo) == 64
    assert ctypes.sizeof(HeuristicResult) == 96
    assert HeuristicResult.workspace_size.offset == 64 and HeuristicResult.state.offset == 72


def test_split_k_counts():
    assert split_k_counts(None) == () and split_k_counts("") == () and split_k_counts("  ") == ()
    assert split_k_counts("4,2, 3,2") == (2, 3, 4)  # sorted, each once
    assert split_k_counts(str(MAX_SPLIT_K)) == (MAX_SPLIT_K,)
    for bad in ("1", "2,x", f"{MAX_SPLIT_K + 1}", ",", "-2"):
        with pytest.raises(ValueError, match=SPLIT_K_ENV):
            split_k_counts(bad)
