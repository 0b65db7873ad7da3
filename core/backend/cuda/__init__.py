"""CUDA backend: CuPy + our kernels + cuBLAS (bf16). Imported only when a GPU is used.

Modules, one job each: ``bf16`` (host conversions, no CuPy), ``loader`` (cached kernel
compilation), ``cublas`` (capturable GEMMs), ``linear`` (GEMM dispatch), ``batch`` (inputs to
the device), ``attention``, ``sampler``, and ``backend`` (the ``CudaBackend`` tying them
together). ``CudaBackend`` is resolved lazily so ``bf16`` imports without CuPy.
"""

from __future__ import annotations

import functools
import hashlib
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = ["CudaBackend", "headers_digest", "kernel_include_dir", "kernel_include_options"]


def kernel_include_dir() -> Path:
    """The folder of core's CUDA sources and headers, for NVRTC's (or g++'s) ``-I``.

    A plugin's own kernels ``#include "common.cuh"`` from it (bf16 typedef and 16-byte loads,
    ``warp_sum`` / ``warp_max`` / ``block_sum`` / ``block_max``) instead of copying them; the
    folder ships as package data. Needs no CuPy, so host-compiled kernel tests can ask for it."""
    return Path(str(resources.files("openinfer.kernels")))


@functools.cache
def headers_digest(*folders: Path) -> str:
    """A digest of every ``*.cuh`` in ``folders`` (core's kernel folder when none is given).

    CuPy's on-disk kernel cache is keyed on a module's source text and options, not on the
    headers it includes: passing this digest as a define makes an edited header recompile its
    modules instead of loading a stale binary."""
    digest = hashlib.sha256()
    for folder in folders or (kernel_include_dir(),):
        for header in sorted(Path(folder).glob("*.cuh")):
            digest.update(header.name.encode() + b"\0" + header.read_bytes())
    return digest.hexdigest()[:16]


def kernel_include_options(*plugin_folders: Path) -> tuple[str, ...]:
    """NVRTC options for a module that includes headers: ``-I`` for each plugin folder and core's,
    and a define carrying the headers' digest (see ``headers_digest``)."""
    folders = (*plugin_folders, kernel_include_dir())
    return (*(f"-I{folder}" for folder in folders), f"-DOPENINFER_HEADERS_DIGEST=0x{headers_digest(*folders)}")


def __getattr__(name: str) -> Any:
    if name == "CudaBackend":
        from openinfer.backend.cuda.backend import CudaBackend

        return CudaBackend
    raise AttributeError(f"module 'openinfer.backend.cuda' has no attribute {name!r}")
