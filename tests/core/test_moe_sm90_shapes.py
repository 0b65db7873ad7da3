"""moe_sm90.cu's small-step tile shapes (moe_sm90.SM90_SHAPES) and its programmatic-dependent-launch
build (SM90_PDL) build for sm_90a without spills, and each shape's shared memory fits the kernel's
limit (CPU: nvcc only)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from openinfer.backend.cuda import kernel_include_dir

KERNEL_DIR = kernel_include_dir()
# (defines) of the shapes' builds beyond test_cuda_sources' default ones
SHAPE_BUILDS = [
    {"SM90_FUSE_SILU": 1, "SM90_TILE_M": 64, "SM90_STAGES": 5, "SM90_SKIP_EMPTY": 0},
    {"SM90_FUSE_SILU": 1, "SM90_TILE_M": 64, "SM90_TILE_N": 128, "SM90_STAGES": 8, "SM90_SKIP_EMPTY": 0},
    {"SM90_FUSE_SILU": 0, "SM90_TILE_N": 128, "SM90_STAGES": 6, "SM90_SKIP_EMPTY": 1},
    {"SM90_FUSE_SILU": 1, "SM90_PDL": 1},
    {"SM90_FUSE_SILU": 0, "SM90_PDL": 1, "SM90_TILE_M": 64, "SM90_STAGES": 5},
    {"SM90_FUSE_SILU": 1, "SM90_STREAM_K": 1, "SM90_SKIP_EMPTY": 1},
    {"SM90_FUSE_SILU": 0, "SM90_STREAM_K": 1, "SM90_PDL": 1, "SM90_TILE_N": 128, "SM90_STAGES": 6},
    {"SM90_FUSE_SILU": 1, "SM90_K_SUB": 2, "SM90_TILE_M": 64, "SM90_TILE_N": 128, "SM90_STREAM_K": 1},
    {"SM90_FUSE_SILU": 0, "SM90_K_SUB": 2, "SM90_TILE_M": 64, "SM90_TILE_N": 128, "SM90_PDL": 1},
    {"SM90_FUSE_SILU": 1, "SM90_K_SUB": 2, "SM90_TILE_M": 64, "SM90_TILE_N": 128, "SM90_PDL": 2, "SM90_ROTATE": 2},
    {"SM90_FUSE_SILU": 1, "SM90_K_SUB": 2, "SM90_TILE_M": 64, "SM90_TILE_N": 128, "SM90_PDL": 1, "SM90_L2_AHEAD": 4,
     "SM90_B_FIRST": 1},
    {"SM90_FUSE_SILU": 0, "SM90_L2_AHEAD": 8},
    {"SM90_FUSE_SILU": 1, "SM90_K_SUB": 2, "SM90_TILE_M": 64, "SM90_TILE_N": 128, "SM90_STAGES": 2, "SM90_PDL": 1},
    {"SM90_FUSE_SILU": 1, "SM90_TILE_M": 64, "SM90_TILE_N": 128, "SM90_STAGES": 4, "SM90_PDL": 1},
]


@pytest.mark.parametrize("defines", SHAPE_BUILDS, ids=lambda d: "-".join(f"{k[5:]}{v}" for k, v in d.items()))
def test_shape_builds_without_spills(defines, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not installed")
    result = subprocess.run([nvcc, "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17", f"-I{KERNEL_DIR}",
                             *(f"-D{k}={v}" for k, v in defines.items()), "-Xptxas", "-v", "-cubin",
                             str(KERNEL_DIR / "moe_sm90.cu"), "-o", str(tmp_path / "out.cubin")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "0 bytes spill stores" in result.stderr


def test_shapes_fit_shared_memory():
    moe_sm90 = pytest.importorskip("openinfer.backend.cuda.moe_sm90")
    for name, shape in moe_sm90.SM90_SHAPES.items():
        assert shape.shared_bytes() <= moe_sm90.SM90_MAX_SHARED_BYTES, name
        assert shape.threads == (384 if shape.tile_m == 128 else 256), name
        # CTAs sharing an SM fit its 228 KB of shared memory (1 KB reserved per CTA, the static offset tables)
        assert shape.ctas_per_sm * (shape.shared_bytes() + 1024 + 2 * 513 * 4) <= 228 * 1024, name
