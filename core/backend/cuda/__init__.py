"""CUDA backend: CuPy + our kernels + cuBLAS (bf16). Imported only when a GPU is used.

Modules, one job each: ``bf16`` (host conversions, no CuPy), ``loader`` (cached kernel
compilation), ``cublas`` (capturable GEMMs), ``linear`` (GEMM dispatch), ``batch`` (inputs to
the device), ``attention``, ``sampler``, and ``backend`` (the ``CudaBackend`` tying them
together). ``CudaBackend`` is resolved lazily so ``bf16`` imports without CuPy.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

__all__ = ["CudaBackend", "kernel_include_dir"]


def kernel_include_dir() -> Path:
    """The folder of core's CUDA sources and headers, for NVRTC's (or g++'s) ``-I``.

    A plugin's own kernels ``#include "common.cuh"`` from it (bf16 typedef and 16-byte loads,
    ``warp_sum`` / ``warp_max`` / ``block_sum`` / ``block_max``) instead of copying them; the
    folder ships as package data. Needs no CuPy, so host-compiled kernel tests can ask for it."""
    return Path(str(resources.files("openinfer.kernels")))


def __getattr__(name: str) -> Any:
    if name == "CudaBackend":
        from openinfer.backend.cuda.backend import CudaBackend

        return CudaBackend
    raise AttributeError(f"module 'openinfer.backend.cuda' has no attribute {name!r}")
