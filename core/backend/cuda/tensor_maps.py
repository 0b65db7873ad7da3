"""TMA tensor maps of paged KV caches for the Hopper prefill kernel's ``TMA_KV_LOADS`` variant.

A map describes one layer's K (or V) cache ``[num_blocks, block_size, num_kv_heads, head_dim]``
(bf16, contiguous) as a 3-d tensor (element, KV head, cache token) whose box is one page of one
KV head, 64 elements (128 bytes, the 128-byte swizzle wgmma reads) wide: the kernel copies page
``p``'s column block ``c`` with coordinates ``(64 c, kv_head, p * block_size)``. The driver encodes
it (``cuTensorMapEncodeTiled`` through ctypes: CuPy does not wrap it) once per cache array, and the
kernel takes the 128-byte map by value (a ``__grid_constant__`` parameter).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # no CuPy at run time: CPU CI tests the layout
    import cupy

BOX_ELEMENTS = 64  # 128 bytes of bf16: the widest box the 128-byte swizzle takes
MAP_BYTES = 128
# CUtensorMap* enums (cuda.h)
_DATA_TYPE_UINT16 = 1  # bf16 bits; the copy moves bytes only
_INTERLEAVE_NONE = 0
_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3
_OOB_FILL_NONE = 0


@dataclass(frozen=True)
class PageBoxLayout:
    """cuTensorMapEncodeTiled's arguments for one paged cache (innermost dimension first)."""

    dims: tuple[int, int, int]  # elements of a head, KV heads, cache tokens
    strides: tuple[int, int]  # bytes between KV heads, between cache tokens
    box: tuple[int, int, int]  # 64 elements x 1 head x one page of tokens


def page_box_layout(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int,
                    box_tokens: int | None = None) -> PageBoxLayout:
    """The tensor-map layout of a KV cache array of ``shape`` ``[blocks, block_size, kv_heads, head_dim]``
    with byte ``strides``; ValueError where TMA cannot copy it page by page. ``box_tokens``: a box of
    that many cache tokens (whole pages, at most 256) instead of one page, for runs of consecutive
    blocks (prefill_attention_sm90.cu's KV_RUNS)."""
    if len(shape) != 4 or itemsize != 2:
        raise ValueError(f"a paged bf16 cache [blocks, block_size, kv_heads, head_dim] is needed, got {shape}")
    blocks, block_size, kv_heads, head_dim = shape
    contiguous = (block_size * kv_heads * head_dim * 2, kv_heads * head_dim * 2, head_dim * 2, 2)
    if tuple(strides) != contiguous:
        raise ValueError(f"the cache must be contiguous for TMA page copies, got strides {strides}")
    if head_dim % BOX_ELEMENTS or not 1 <= block_size <= 256:
        raise ValueError(f"TMA page copies need head_dim a multiple of {BOX_ELEMENTS} and at most 256 tokens "
                         f"per block, got head_dim {head_dim}, block size {block_size}")
    if box_tokens is None:
        box_tokens = block_size
    if not 1 <= box_tokens <= 256 or box_tokens % block_size:
        raise ValueError(f"a TMA box spans whole pages of {block_size} tokens, at most 256, got {box_tokens}")
    return PageBoxLayout(dims=(head_dim, kv_heads, blocks * block_size),
                         strides=(head_dim * 2, kv_heads * head_dim * 2),
                         box=(BOX_ELEMENTS, 1, box_tokens))


@functools.cache
def _driver() -> ctypes.CDLL:
    driver = ctypes.CDLL("libcuda.so.1")
    driver.cuTensorMapEncodeTiled.restype = ctypes.c_int
    return driver


def encode_page_map(address: int, layout: PageBoxLayout) -> np.ndarray:
    """The 128-byte CUtensorMap (host bytes) of the cache at device ``address``."""
    out = np.zeros(MAP_BYTES, np.uint8)
    dims = (ctypes.c_uint64 * 3)(*layout.dims)
    strides = (ctypes.c_uint64 * 2)(*layout.strides)
    box = (ctypes.c_uint32 * 3)(*layout.box)
    element_strides = (ctypes.c_uint32 * 3)(1, 1, 1)
    holder = (ctypes.c_uint8 * (MAP_BYTES + 64))()  # the driver wants a 64-byte aligned map
    aligned = (ctypes.addressof(holder) + 63) & ~63
    status = _driver().cuTensorMapEncodeTiled(
        ctypes.c_void_p(aligned), _DATA_TYPE_UINT16, ctypes.c_uint32(3), ctypes.c_void_p(address), dims, strides,
        box, element_strides, _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_256B, _OOB_FILL_NONE)
    if status != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {status}) for {layout}")
    ctypes.memmove(out.ctypes.data, aligned, MAP_BYTES)
    return out


# One CUtensorMap as a size-1 NumPy array: CuPy passes it to the kernel by value (its 128 bytes
# become the kernel's __grid_constant__ TensorMap parameter).
TENSOR_MAP_PARAM = np.dtype([("opaque", np.uint8, MAP_BYTES)])


class PageMaps:
    """The page-box tensor map of each cache array, encoded once per array (host bytes: a map is
    a kernel parameter, so nothing is uploaded and a CUDA graph captures it like any argument).
    Keyed by device address and layout (a map holds nothing else), so a cache freed and
    reallocated at the same address with the same shape reuses a map that is still right."""

    def __init__(self) -> None:
        self._maps: dict[tuple[int, PageBoxLayout], np.ndarray] = {}

    def get(self, cache: cupy.ndarray, box_tokens: int | None = None) -> np.ndarray:
        """The tensor map of ``cache`` as a kernel argument (a size-1 array of TENSOR_MAP_PARAM), its
        box one page or ``box_tokens`` tokens (whole pages)."""
        key = (cache.data.ptr, page_box_layout(cache.shape, cache.strides, cache.itemsize, box_tokens))
        found = self._maps.get(key)
        if found is None:
            found = encode_page_map(*key).view(TENSOR_MAP_PARAM)
            self._maps[key] = found
        return found


page_maps = PageMaps()
