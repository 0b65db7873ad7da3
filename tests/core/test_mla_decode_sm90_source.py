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


@pytest.mark.parametrize("source,arch", [("mla.cu", "sm_90"), ("mla_decode_sm90.cu", "sm_90a")])
def test_mla_decode_kernels_build_with_pdl(source, arch, tmp_path):
    """MLA_PDL=1 (core's $OPENINFER_MLA_PDL): the decode kernels build, each with one griddepcontrol.wait and one
    launch_dependents (mla_split.cuh mla_pdl_enter), and without the define none."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not installed")
    counts = []
    for pdl in (0, 1):
        ptx = tmp_path / f"out{pdl}.ptx"
        result = subprocess.run([nvcc, f"-arch={arch}", "-std=c++17", f"-I{KERNEL_DIR}", "-DKV_LORA=512", "-DROPE_DIM=64",
                                 "-DTMA_ROW_BOXES=1", f"-DMLA_PDL={pdl}", "-ptx", str(KERNEL_DIR / source), "-o", str(ptx)],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        text = ptx.read_text()
        counts.append((text.count("griddepcontrol.wait"), text.count("griddepcontrol.launch_dependents")))
    assert counts[0] == (0, 0)
    # mla.cu: the latent write (and its q_pe-storing form), write + W_UK, W_UK alone, W_UV, the four combines and three
    # attention kernels
    assert counts[1] == ((12, 12) if source == "mla.cu" else (1, 1)), counts


def test_tma_decode_builds_with_early_tiles(tmp_path):
    """MLA_PDL_EARLY_TILES=1 (with MLA_PDL=1; core's $OPENINFER_MLA_PDL_EARLY_TILES): the TMA decode kernel builds for
    sm_90a without spills, still one griddepcontrol.wait, and issues TMA copies on both sides of it."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not installed")
    ptx = tmp_path / "out.ptx"
    common = [nvcc, "-arch=sm_90a", "-std=c++17", f"-I{KERNEL_DIR}", "-DKV_LORA=512", "-DROPE_DIM=64", "-DTMA_ROW_BOXES=1",
              "-DMLA_PDL=1", "-DMLA_PDL_EARLY_TILES=1", str(KERNEL_DIR / "mla_decode_sm90.cu")]
    result = subprocess.run([*common, "-ptx", "-o", str(ptx)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    text = ptx.read_text()
    assert text.count("griddepcontrol.wait") == 1
    wait = text.index("griddepcontrol.wait")
    assert "cp.async.bulk.tensor" in text[:wait] and "cp.async.bulk.tensor" in text[wait:]
    result = subprocess.run([*common, "-Xptxas", "-v", "-cubin", "-o", str(tmp_path / "out.cubin")], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "0 bytes spill stores" in result.stderr


@pytest.mark.parametrize("pdl,write,staged", [(0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 1, 1)])
def test_tma_decode_builds_with_fused_write(pdl, write, staged, tmp_path):
    """TMA_FUSED_WRITE=1 (the latent write folded in, core's $OPENINFER_MLA_FUSED_WRITE) and TMA_Q_TILE=1 (the query
    rows staged by 16-byte loads, $OPENINFER_MLA_TMA_Q_TILE), with and without MLA_PDL: the default tile builds for
    sm_90a without spills or a stack frame."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not installed")
    common = [nvcc, "-arch=sm_90a", "-std=c++17", f"-I{KERNEL_DIR}", "-DKV_LORA=512", "-DROPE_DIM=64", "-DTMA_KEYS=32",
              "-DTMA_STAGES=2", "-DTMA_ROW_BOXES=1", f"-DMLA_PDL={pdl}", f"-DTMA_FUSED_WRITE={write}",
              f"-DTMA_Q_TILE={staged}", str(KERNEL_DIR / "mla_decode_sm90.cu")]
    result = subprocess.run([*common, "-Xptxas", "-v", "-cubin", "-o", str(tmp_path / "out.cubin")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert re.search(r"0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", result.stderr), result.stderr
    assert int(re.search(r"Used (\d+) registers", result.stderr).group(1)) <= 255, result.stderr
