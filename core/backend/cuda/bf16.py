"""bf16 on the host: float32 <-> bfloat16 bit patterns (uint16), round to nearest even.

No CuPy here, so the conversions are testable on the CPU. A uint16 array is taken to already
hold bf16 bits (what ``openinfer.Checkpoint`` returns for bf16 tensors).
"""

from __future__ import annotations

import numpy as np


def float_to_bf16_bits(array: np.ndarray) -> np.ndarray:
    """float32 (or anything castable) -> uint16 bf16 bits, round-to-nearest-even, NaN kept NaN."""
    if array.dtype == np.uint16:
        return np.ascontiguousarray(array)
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = np.isnan(array)
    out = rounded.astype(np.uint16)
    if nan.any():
        out[nan] = np.uint16(0x7FC0)
    return out


def bf16_bits_to_float(bits: np.ndarray) -> np.ndarray:
    """uint16 bf16 bits -> float32 (exact)."""
    return (np.ascontiguousarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_to_bf16(array: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bf16, as float32 (what a bf16 tensor holds)."""
    return bf16_bits_to_float(float_to_bf16_bits(array))
