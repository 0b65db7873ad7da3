"""benchmarks/gpu_step_timeline.py's host-side parts (CPU): switch sets from the command line, and one replay's
kernel records summed into device time, gaps (overlap where a kernel starts before the previous one ends) and the
middle MoE layer's kernel sequence."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_step_timeline  # noqa: E402


def test_parse_variant():
    assert gpu_step_timeline.parse_variant("base=") == ("base", {})
    assert gpu_step_timeline.parse_variant("both=OPENINFER_A=1,OPENINFER_B=x") == (
        "both", {"OPENINFER_A": "1", "OPENINFER_B": "x"})
    for bad in ("=OPENINFER_A=1", "a=PATH=/bin", "a=OPENINFER_A"):
        with pytest.raises(argparse.ArgumentTypeError):
            gpu_step_timeline.parse_variant(bad)


def _kernel(name: str, start: float, dur: float) -> dict:
    return {"name": name, "start_us": start, "dur_us": dur}


def test_summarise_gaps_overlap_and_middle_layer():
    replay = [_kernel("norm", 0, 2), _kernel("moe_combine", 3, 1),  # gap 1
              _kernel("gemm", 5, 10), _kernel("pdl_next", 14, 3), _kernel("moe_combine", 18, 1),  # gap 1, overlap 1, gap 1
              _kernel("norm", 19, 2), _kernel("moe_combine", 22, 1)]  # gap 0, gap 1
    summary = gpu_step_timeline.summarise(replay)
    assert summary["kernels"] == 7
    assert summary["span_us"] == 23
    assert summary["kernel_sum_us"] == 20
    assert summary["gap_sum_us"] == 4 and summary["overlap_sum_us"] == 1
    assert summary["by_name"]["moe_combine"] == {"count": 3, "dur_us": 3, "gap_before_us": 3}
    # the layer between the first and second MoE layer ends (3 ends: the middle one is the second)
    assert [k["name"] for k in summary["middle_layer"]] == ["gemm", "pdl_next", "moe_combine"]
    assert [k["gap_before_us"] for k in summary["middle_layer"]] == [1, -1, 1]


def test_as_float_widens_bf16_bits():
    import numpy as np

    bits = np.array([0x3F80, 0xC000], dtype=np.uint16)  # 1.0, -2.0
    assert gpu_step_timeline.as_float(bits).tolist() == [1.0, -2.0]
    assert gpu_step_timeline.as_float(np.array([0.5], np.float64)).dtype == np.float32
