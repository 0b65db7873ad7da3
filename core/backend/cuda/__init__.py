"""CUDA backend: CuPy + our kernels + cuBLAS (bf16). Imported only when a GPU is used.

Modules, one job each: ``bf16`` (host conversions, no CuPy), ``loader`` (cached kernel
compilation), ``cublas`` (capturable GEMMs), ``linear`` (GEMM dispatch), ``batch`` (inputs to
the device), ``attention``, ``sampler``, and ``backend`` (the ``CudaBackend`` tying them
together). ``CudaBackend`` is resolved lazily so ``bf16`` imports without CuPy.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CudaBackend"]


def __getattr__(name: str) -> Any:
    if name == "CudaBackend":
        from openinfer.backend.cuda.backend import CudaBackend

        return CudaBackend
    raise AttributeError(f"module 'openinfer.backend.cuda' has no attribute {name!r}")
