"""moe_sm90.cu's tiled weight layout (SM90_TILED_B), built with NumPy or CuPy (no CUDA import: CPU-testable)."""

from __future__ import annotations

import numpy as np

TILE_K = 64  # moe_sm90.cu SM90_TILE_K: one 128-byte swizzle row of bf16


def tiled_weight(data, tile_n: int, fuse_silu: bool, xp=np):
    """``data`` ``[E, N, K]`` (bf16 bits) repacked for SM90_TILED_B: ``[E · n_tiles · k_tiles · tile_n, 64]``, block
    (e, j, kt) (rows ((e · n_tiles + j) · k_tiles + kt) · tile_n ...) holding weight rows of output tile j and k
    columns 64 kt .. 64 kt + 63; fused gate_up (N = 2 I): the block's first tile_n / 2 rows are gate rows
    j · tile_n / 2 .., the rest the same up rows. Zeros past N (I) and K. ``xp``: cupy or numpy."""
    experts, n, k = (int(d) for d in data.shape)
    k_tiles = -(-k // TILE_K)
    if fuse_silu:
        if n % 2:
            raise ValueError(f"a fused gate_up weight has an even N, got {n}")
        rows, halves = tile_n // 2, 2
        n_tiles = -(-(n // 2) // rows)
        source = data.reshape(experts, 2, n // 2, k)
    else:
        rows, halves = tile_n, 1
        n_tiles = -(-n // rows)
        source = data.reshape(experts, 1, n, k)
    if source.shape[2] != n_tiles * rows or k != k_tiles * TILE_K:
        padded = xp.zeros((experts, halves, n_tiles * rows, k_tiles * TILE_K), dtype=data.dtype)
        padded[:, :, :source.shape[2], :k] = source
        source = padded
    blocks = source.reshape(experts, halves, n_tiles, rows, k_tiles, TILE_K).transpose(0, 2, 4, 1, 3, 5)
    return xp.ascontiguousarray(blocks).reshape(-1, TILE_K)
