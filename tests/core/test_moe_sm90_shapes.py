"""moe_sm90.cu's small-step tile shapes (moe_sm90.SM90_SHAPES) and its programmatic-dependent-launch
build (SM90_PDL) build for sm_90a without spills, and each shape's shared memory fits the kernel's
limit (CPU: nvcc only)."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
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
    {"SM90_FUSE_SILU": 1, "SM90_TILE_M": 64, "SM90_TILE_N": 128, "SM90_STAGES": 4, "SM90_PDL": 1, "SM90_TILED_B": 128},
    {"SM90_FUSE_SILU": 0, "SM90_TILE_M": 64, "SM90_TILE_N": 128, "SM90_STAGES": 4, "SM90_STREAM_K": 1,
     "SM90_TILED_B": 128},
    {"SM90_FUSE_SILU": 1, "SM90_TILED_B": 128},
    {"SM90_FUSE_SILU": 0, "SM90_TILED_B": 128, "SM90_PDL": 1},
    {"SM90_FUSE_SILU": 1, "SM90_TILE_M": 64, "SM90_TILE_N": 128, "SM90_STAGES": 4, "SM90_PDL": 1, "SM90_K_ROTATE": 1},
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


@pytest.mark.parametrize("fuse_silu", [False, True])
@pytest.mark.parametrize("tile_n", [128, 256])
def test_tiled_weight_blocks(fuse_silu, tile_n):
    """sm90_tiles.tiled_weight (SM90_TILED_B's layout, NumPy here): weight row n, column k of expert e sits in block
    (e, j, kt) where the kernel's tiled_block_row reads it — fused gate_up: gate row n of tile j = n // (tile_n / 2)
    at the block's row n % (tile_n / 2), its up row tile_n / 2 further; zeros past N and K (a partial tile and k-tile)."""
    from openinfer.backend.cuda.sm90_tiles import tiled_weight

    experts, n, k = 3, 2 * 152 if fuse_silu else 200, 200
    data = np.arange(experts * n * k, dtype=np.uint32).reshape(experts, n, k).astype(np.uint16)
    data[data == 0] = 1  # zero marks padding below
    tiled = tiled_weight(data, tile_n, fuse_silu)
    k_tiles, rows = -(-k // 64), tile_n // 2 if fuse_silu else tile_n
    out_n = n // 2 if fuse_silu else n
    n_tiles = -(-out_n // rows)
    assert tiled.shape == (experts * n_tiles * k_tiles * tile_n, 64)
    for e in range(experts):
        for row in range(n):
            half, out_row = divmod(row, out_n) if fuse_silu else (0, row)
            j, r = divmod(out_row, rows)
            for kt in range(k_tiles):
                block = ((e * n_tiles + j) * k_tiles + kt) * tile_n + half * rows + r
                width = min(64, k - 64 * kt)
                assert np.array_equal(tiled[block, :width], data[e, row, 64 * kt: 64 * kt + width])
                assert not tiled[block, width:].any()
    assert np.count_nonzero(tiled) == data.size  # everything else is padding
