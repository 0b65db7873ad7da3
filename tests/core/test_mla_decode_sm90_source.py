"""CPU CI for mla_decode_sm90.cu: the TMA-fed absorbed decode kernel builds for sm_90a with the local nvcc at
the tile choices core can launch (keys per tile x ring stages, splits combined in a cluster or not;
DeepSeek-V3 / Kimi-K2 / Moonlight's latent of 512 + 64), without spills or a stack frame (the query
fragments of a warp's score dims and its output quarter live in registers for the whole kernel)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

KERNEL_DIR = Path(__file__).resolve().parents[2] / "core" / "kernels"


@pytest.mark.parametrize("keys,stages,cluster,one_barrier,row_boxes", [
    (32, 2, 1, 0, 0), (16, 4, 1, 0, 0), (32, 5, 1, 0, 0), (64, 2, 1, 0, 0), (16, 1, 1, 0, 0), (32, 2, 8, 0, 0),
    (16, 4, 4, 0, 0), (32, 2, 2, 0, 0), (32, 2, 1, 1, 0), (16, 4, 8, 1, 0), (32, 2, 16, 0, 0), (32, 2, 1, 0, 1),
    (16, 4, 16, 1, 1)])
def test_mla_decode_sm90_builds_without_spills(keys, stages, cluster, one_barrier, row_boxes, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not installed")
    result = subprocess.run([nvcc, "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17", f"-I{KERNEL_DIR}",
                             "-DKV_LORA=512", "-DROPE_DIM=64", f"-DTMA_KEYS={keys}", f"-DTMA_STAGES={stages}", f"-DTMA_CLUSTER={cluster}",
                             f"-DTMA_ONE_BARRIER={one_barrier}", f"-DTMA_ROW_BOXES={row_boxes}",
                             "-Xptxas", "-v", "-cubin", str(KERNEL_DIR / "mla_decode_sm90.cu"),
                             "-o", str(tmp_path / "out.cubin")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert re.search(r"0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", result.stderr), result.stderr
    # two blocks of 128 threads per SM need at most 256 registers a thread (core's REGISTER_BLOCKS_PER_SM)
    registers = int(re.search(r"Used (\d+) registers", result.stderr).group(1))
    assert registers <= 255, result.stderr


def test_mla_write_absorb_keeps_its_accumulators_in_registers(tmp_path):
    """mla.cu's mla_write_absorb: no stack frame (its 16 x 8 accumulators and W_UK vectors stay in registers; a row
    loop bounded by the step's row count rather than the build's would put them in local memory)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not installed")
    result = subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", f"-I{KERNEL_DIR}", "-DKV_LORA=512", "-DROPE_DIM=64",
                             "-Xptxas", "-v", "-cubin", str(KERNEL_DIR / "mla.cu"),
                             "-o", str(tmp_path / "out.cubin")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    found = re.search(r"Function properties for mla_write_absorb\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores",
                      result.stderr)
    assert found and found.groups() == ("0", "0"), result.stderr



@pytest.mark.parametrize("columns", [16, 32, 64])
def test_mla_combine_expand_keeps_its_fragments_in_registers(columns, tmp_path):
    """mla.cu's mla_combine_expand ($OPENINFER_MLA_COMBINE_EXPAND's 16 / 32 / 64 columns a block): no stack frame
    (each warp's W_UV fragments, loaded before the merge, held beside the merge's 16 partial vectors in flight) and
    at most 128 registers a thread (512 threads an SM)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not installed")
    result = subprocess.run([nvcc, "-arch=sm_90a", "-std=c++17", f"-I{KERNEL_DIR}", "-DKV_LORA=512", "-DROPE_DIM=64",
                             f"-DCOMBINE_EXPAND_COLUMNS={columns}", "-Xptxas", "-v", "-cubin",
                             str(KERNEL_DIR / "mla.cu"), "-o", str(tmp_path / "out.cubin")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    found = re.search(r"Function properties for mla_combine_expand\n\s*(\d+) bytes stack frame, (\d+) bytes spill "
                      r"stores.*?\n.*?Used (\d+) registers", result.stderr)
    assert found and found.groups()[:2] == ("0", "0") and int(found.group(3)) <= 128, result.stderr

@pytest.mark.parametrize("write,staged", [(1, 0), (0, 1), (1, 1)])
def test_tma_decode_builds_with_fused_write(write, staged, tmp_path):
    """TMA_FUSED_WRITE=1 (the latent write folded in, core's $OPENINFER_MLA_FUSED_WRITE) and TMA_Q_TILE=1 (the query
    rows staged by 16-byte loads, $OPENINFER_MLA_TMA_Q_TILE): the default tile builds for sm_90a without spills or a
    stack frame."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not installed")
    common = [nvcc, "-arch=sm_90a", "-std=c++17", f"-I{KERNEL_DIR}", "-DKV_LORA=512", "-DROPE_DIM=64", "-DTMA_KEYS=32",
              "-DTMA_STAGES=2", "-DTMA_ROW_BOXES=1", f"-DTMA_FUSED_WRITE={write}",
              f"-DTMA_Q_TILE={staged}", str(KERNEL_DIR / "mla_decode_sm90.cu")]
    result = subprocess.run([*common, "-Xptxas", "-v", "-cubin", "-o", str(tmp_path / "out.cubin")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert re.search(r"0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", result.stderr), result.stderr
    assert int(re.search(r"Used (\d+) registers", result.stderr).group(1)) <= 255, result.stderr
