"""Programmatic dependent launch (PDL): a kernel launched by ``launch(..., after_previous=True)`` goes through
``cuLaunchKernelEx`` with programmatic stream serialization, so the driver may start its CTAs once every CTA
of the stream's previous kernel has run ``griddepcontrol.launch_dependents``; the kernel's own
``griddepcontrol.wait`` holds its dependent reads and its writes until that kernel has finished. Under
stream capture the launch becomes a programmatic edge of the graph. Used by the Hopper grouped expert GEMM
($OPENINFER_MOE_SM90_PDL, down after gate_up) and the MoE combine ($OPENINFER_MOE_COMBINE_PDL); a kernel
launched so must be built to wait.
"""

from __future__ import annotations

import ctypes
import functools

import cupy
import numpy as np


class _LaunchAttribute(ctypes.Structure):  # cuda.h CUlaunchAttribute: id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("value", ctypes.c_ubyte * 64)]


class _LaunchConfig(ctypes.Structure):  # cuda.h CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


@functools.cache
def _launch_kernel_ex():
    function = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    function.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                         ctypes.c_void_p]
    function.restype = ctypes.c_int
    return function


def kernel_argument(value) -> np.ndarray:
    """The bytes a kernel parameter points to: a device array's address, a NumPy scalar or a host array (a
    tensor map) as themselves. Python numbers have no width: a TypeError."""
    if isinstance(value, cupy.ndarray):
        return np.array([value.data.ptr], dtype=np.uint64)
    if not isinstance(value, (np.generic, np.ndarray)):
        raise TypeError(f"kernel arguments are device arrays or NumPy scalars / arrays, got {type(value).__name__}")
    return np.ascontiguousarray(np.asarray(value).reshape(-1))


def _dims(value) -> tuple[int, int, int]:
    dims = tuple(int(v) for v in (value if isinstance(value, tuple) else (value,)))
    return (dims + (1, 1, 1))[:3]


def launch(fn, grid, block, args: tuple, shared_mem: int = 0, after_previous: bool = False) -> None:
    """``fn(grid, block, args, shared_mem=shared_mem)``; with ``after_previous`` by cuLaunchKernelEx with
    programmatic stream serialization (the kernel must be built to wait: its griddepcontrol.wait is what orders
    it after the previous kernel). On the legacy default stream, under ``discover_kernels`` (a stand-in
    ``fn``) or without ``after_previous``: a plain launch."""
    function = fn.kernel if isinstance(fn, cupy.RawKernel) else fn
    stream = cupy.cuda.get_current_stream().ptr
    if not after_previous or not stream or not isinstance(function, cupy.cuda.function.Function):
        fn(grid, block, args, shared_mem=shared_mem)
        return
    held = [kernel_argument(value) for value in args]  # alive until the launch returns (it copies them)
    pointers = (ctypes.c_void_p * len(held))(*[value.ctypes.data for value in held])
    attribute = _LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION)
    attribute.value[0] = 1  # programmaticStreamSerializationAllowed (an int)
    config = _LaunchConfig(_dims(grid), _dims(block), int(shared_mem), stream, ctypes.pointer(attribute), 1)
    status = _launch_kernel_ex()(ctypes.byref(config), function.ptr, pointers, None)
    if status != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed (CUresult {status}) launching a kernel with programmatic "
                           "dependent launch")
