"""The one cached loader of openinfer's CUDA sources (``openinfer/kernels/*.cu``).

``kernel("rms_norm.cu", "rms_norm")`` compiles the file once per (file, defines) with NVRTC
through ``cupy.RawModule`` (CuPy also caches the binary on disk per source, options and GPU
architecture) and returns the ``RawKernel``. ``arch_kernel("x.cu", "x", "sm_90a")`` builds for an
architecture-specific target (wgmma and setmaxnreg need sm_90a), which RawModule cannot ask for: it
always appends its own ``-arch=sm_XY``. Package files are only read.
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


MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CUfunction_attribute


@functools.cache
def _arch_module(source: str, defines: tuple[tuple[str, int], ...], arch: str) -> cupy.cuda.function.Module:
    from cupy._core.core import assemble_cupy_compiler_options
    from cupy_backends.cuda.libs import nvrtc

    path = KERNEL_DIR / source
    if not path.is_file():
        raise FileNotFoundError(f"CUDA source {path} is missing; reinstall openinfer (package data *.cu)")
    options = assemble_cupy_compiler_options(
        ("-std=c++17", f"-I{KERNEL_DIR}", f"--gpu-architecture={arch}",
         *(f"-D{name}={value}" for name, value in defines)))
    program = nvrtc.createProgram(path.read_text(), source, (), ())
    try:
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as error:
            raise RuntimeError(f"NVRTC could not build {source} for {arch}:\n{nvrtc.getProgramLog(program)}") from error
        cubin = nvrtc.getCUBIN(program)
    finally:
        nvrtc.destroyProgram(program)
    module = cupy.cuda.function.Module()
    module.load(cubin)
    return module


@functools.cache
def _arch_kernel(source: str, name: str, arch: str, defines: tuple[tuple[str, int], ...],
                 shared_bytes: int) -> cupy.cuda.function.Function:
    function = _arch_module(source, defines, arch).get_function(name)
    if shared_bytes > 48 * 1024:
        cupy.cuda.driver.funcSetAttribute(function.ptr, MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_bytes)
    return function


def arch_kernel(source: str, name: str, arch: str, shared_bytes: int = 0, **defines: int) -> cupy.cuda.function.Function:
    """Kernel ``name`` of ``source`` compiled by NVRTC straight to a cubin for ``arch`` (e.g. "sm_90a"),
    its dynamic shared-memory limit raised to ``shared_bytes``; called like a RawKernel:
    ``fn(grid, block, args, shared_mem=...)``."""
    return _arch_kernel(source, name, arch, tuple(sorted(defines.items())), shared_bytes)
