"""CPU CI for mla_prefill_sm90.cu: its wgmma kernel builds for sm_90a with the local nvcc for the MLA shapes
core launches it with (DeepSeek-V3 / Kimi-K2 / Moonlight: nope 128 + rope 64, v 128; a 64 + 64 one), with
neither spills nor a stack frame (its consumer warpgroups hold S, O and P in registers); test_cuda_sources
builds every source for plain sm_90, where this kernel is a trap."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

KERNEL_DIR = Path(__file__).resolve().parents[2] / "core" / "kernels"


# (nope, rope, keys per tile, ping-pong, split K / V, TMA K / V loads, ordered softmax): DeepSeek-V3's shape in variants core
# builds, a 64 + 64 one (64-key tiles by TMA without split K / V spill a few bytes: left out here)
@pytest.mark.parametrize("nope,rope,keys,pingpong,split_kv,tma,ordered", [
    (128, 64, 128, 0, 0, 0, 0), (128, 64, 64, 1, 1, 0, 1), (128, 64, 128, 1, 1, 1, 1), (128, 64, 64, 0, 1, 1, 0),
    (64, 64, 64, 0, 0, 0, 1)])
def test_mla_prefill_sm90_builds_without_spills(nope, rope, keys, pingpong, split_kv, tma, ordered, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not installed")
    result = subprocess.run([nvcc, "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17", f"-I{KERNEL_DIR}",
                             f"-DNOPE_DIM={nope}", f"-DROPE_DIM={rope}", "-DV_DIM=128", f"-DBLOCK_N={keys}",
                             f"-DPINGPONG={pingpong}", f"-DSPLIT_KV={split_kv}", f"-DTMA_KV_LOADS={tma}", f"-DORDERED_SOFTMAX={ordered}",
                             "-DSM90A_TARGET=1", "-Xptxas", "-v", "-c", str(KERNEL_DIR / "mla_prefill_sm90.cu"),
                             "-o", str(tmp_path / "out.o")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert re.search(r"0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", result.stderr), result.stderr
