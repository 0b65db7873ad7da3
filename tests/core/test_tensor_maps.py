"""CPU CI for the TMA page-box layout of paged KV caches (core/backend/cuda/tensor_maps.py):
the dims / strides / box the sm90 prefill kernel's TMA_KV_LOADS variant copies with, and clear
errors for caches it cannot copy page by page."""

from __future__ import annotations

import numpy as np
import pytest

from openinfer.backend.cuda.tensor_maps import BOX_ELEMENTS, page_box_layout


def strides_of(shape: tuple[int, ...]) -> tuple[int, ...]:
    return np.empty(shape, np.uint16).strides


@pytest.mark.parametrize(("blocks", "block_size", "kv_heads", "head_dim"), [(100, 16, 8, 128), (7, 32, 2, 256)])
def test_layout_addresses_one_page_of_one_head(blocks, block_size, kv_heads, head_dim):
    shape = (blocks, block_size, kv_heads, head_dim)
    layout = page_box_layout(shape, strides_of(shape), 2)
    assert layout.dims == (head_dim, kv_heads, blocks * block_size)
    # element (e, h, token) sits at byte e * 2 + h * strides[0] + token * strides[1] of the C-ordered cache
    cache = np.arange(np.prod(shape), dtype=np.int64).reshape(shape)
    flat = cache.reshape(-1)
    for e, h, token in [(0, 0, 0), (head_dim - 1, kv_heads - 1, blocks * block_size - 1), (70, 1, block_size + 3)]:
        byte = e * 2 + h * layout.strides[0] + token * layout.strides[1]
        assert flat[byte // 2] == cache[token // block_size, token % block_size, h, e]
    assert layout.box == (BOX_ELEMENTS, 1, block_size)
    assert BOX_ELEMENTS * 2 == 128  # one 128-byte swizzle row per box row


def test_layouts_tma_cannot_copy_are_clear_errors():
    shape = (10, 16, 8, 128)
    with pytest.raises(ValueError, match="contiguous"):
        page_box_layout(shape, np.empty((10, 16, 8, 256), np.uint16)[..., :128].strides, 2)
    with pytest.raises(ValueError, match="multiple of 64"):
        page_box_layout((10, 16, 8, 32), strides_of((10, 16, 8, 32)), 2)
    with pytest.raises(ValueError, match="bf16"):
        page_box_layout((10, 16, 128), (4096, 256, 2), 2)
