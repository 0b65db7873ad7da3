"""Backends: the ops model code is written against, one implementation per device.

``numpy``: fp32 on the CPU, the reference. ``cuda``: bf16 on NVIDIA GPUs through CuPy, our
kernels (``openinfer/kernels/*.cu``) and cuBLAS. Model code calls ``ops.<op>(...)`` only, so
one model definition runs on both.
"""

from __future__ import annotations

from openinfer.backend.base import AttentionSpec, Backend, DeviceBatch, ForwardBatch, KVLayer
from openinfer.backend.numpy_backend import NumpyBackend
from openinfer.errors import BackendUnavailableError


def cuda_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if cuda_available() else "cpu"
    if device not in ("cuda", "cpu"):
        raise BackendUnavailableError(f"unknown device {device!r}; use cuda, cpu or auto")
    if device == "cuda" and not cuda_available():
        raise BackendUnavailableError(
            "--device cuda needs CuPy and an NVIDIA GPU; install openinfer[cuda13] (or [cuda12]) "
            "on a machine with a GPU, or use --device cpu")
    return device


def create_backend(device: str = "auto") -> Backend:
    """The backend for ``device`` ("auto", "cuda" or "cpu")."""
    if resolve_device(device) == "cuda":
        from openinfer.backend.cuda import CudaBackend

        return CudaBackend()
    return NumpyBackend()


__all__ = ["AttentionSpec", "Backend", "DeviceBatch", "ForwardBatch", "KVLayer", "NumpyBackend",
           "create_backend", "cuda_available", "resolve_device"]
