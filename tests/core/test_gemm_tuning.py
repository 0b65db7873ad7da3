"""The cuBLASLt tuning switch's host-side rules (no GPU): which values turn it on, which GEMMs
take it, which timed candidate wins, and the ctypes layouts of cuBLASLt's structs."""

from __future__ import annotations

import ctypes
import json

import pytest

from openinfer.backend.cuda.gemm_tuning import (
    DEFAULT_TUNING_CACHE,
    MAX_SPLIT_K,
    SPLIT_K_ENV,
    TUNED_MAX_ROWS,
    HeuristicResult,
    MatmulAlgo,
    TuningCache,
    fastest,
    split_k_counts,
    tunable,
    tuning_cache_path,
    tuning_wanted,
    valid_entry,
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


def _entry(**changes):
    return {"algo": bytes(range(64)).hex(), "split_k": 2, "chosen": 9, "candidates": 24, "us": 21.5,
            "first_pick_us": 27.0, **changes}


def test_tuning_cache_path():
    assert tuning_cache_path(None) == DEFAULT_TUNING_CACHE.expanduser()
    assert tuning_cache_path("") == DEFAULT_TUNING_CACHE.expanduser()
    assert tuning_cache_path("off") is None and tuning_cache_path("0") is None
    assert str(tuning_cache_path("/tmp/x.json")) == "/tmp/x.json"


def test_tuning_cache_round_trip_and_keys(tmp_path):
    path = tmp_path / "sub" / "tuning.json"
    cache = TuningCache(path)
    key = TuningCache.key("NVIDIA H200 sm90", 130100, 256, 2560, 9728, (2, 3, 4))
    assert key != TuningCache.key("NVIDIA H200 sm90", 130100, 256, 2560, 9728, ())  # split counts offered
    assert key != TuningCache.key("NVIDIA H100 sm90", 130100, 256, 2560, 9728, (2, 3, 4))
    assert cache.get(key) is None
    cache.put(key, _entry())
    again = TuningCache(path)
    assert again.get(key) == _entry()
    assert not list(path.parent.glob("*.tmp"))  # written through a renamed temporary file
    with pytest.raises(ValueError):
        cache.put(key, _entry(algo="zz"))


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", json.dumps({"k": {"algo": "00"}}),
                                     json.dumps({"k": _entry(algo="g" * 128)}), json.dumps({"k": _entry(chosen="9")})])
def test_a_damaged_tuning_cache_counts_as_empty(tmp_path, content):
    path = tmp_path / "tuning.json"
    path.write_text(content)
    assert TuningCache(path).entries == {}


def test_valid_entry():
    assert valid_entry(_entry()) and valid_entry(_entry(us=20))
    assert not valid_entry(None) and not valid_entry(_entry(candidates=None)) and not valid_entry(_entry(algo=7))
