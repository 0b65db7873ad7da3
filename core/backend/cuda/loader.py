"""The one cached loader of openinfer's CUDA sources (``openinfer/kernels/*.cu``).

``kernel("rms_norm.cu", "rms_norm")`` compiles the file once per (file, defines) with NVRTC
through ``cupy.RawModule`` (CuPy also caches the binary on disk per source, options and GPU
architecture) and returns the ``RawKernel``. Package files are only read.
"""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path

import cupy

KERNEL_DIR = Path(str(resources.files("openinfer.kernels")))


@functools.cache
def _module(source: str, defines: tuple[tuple[str, int], ...]) -> cupy.RawModule:
    path = KERNEL_DIR / source
    if not path.is_file():
        raise FileNotFoundError(f"CUDA source {path} is missing; reinstall openinfer (package data *.cu)")
    options = ("-std=c++17", f"-I{KERNEL_DIR}", *(f"-D{name}={value}" for name, value in defines))
    return cupy.RawModule(code=path.read_text(), options=options)


@functools.cache
def _kernel(source: str, name: str, defines: tuple[tuple[str, int], ...]) -> cupy.RawKernel:
    return _module(source, defines).get_function(name)


def kernel(source: str, name: str, **defines: int) -> cupy.RawKernel:
    """The compiled kernel ``name`` of ``source`` with ``-DNAME=value`` for each define."""
    return _kernel(source, name, tuple(sorted(defines.items())))
