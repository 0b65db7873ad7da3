"""Drive a kernel harness compiled for the host: the CUDA sources (``*.cu``) built with g++
against the stand-in for the CUDA built-ins in ``tests/helpers/cuda_host`` (``cuda_bf16.h`` +
``harness.h``), fed and read back through raw ``NAME.bin`` array files in one directory. Shared
by the emulated kernel tests of core (MoE, MLA), qwen35 (Gated DeltaNet) and deepseek-v4."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from openinfer import bf16_to_float32, float32_to_bf16
from openinfer.backend.cuda import kernel_include_dir

HOST_INCLUDE = Path(__file__).with_name("cuda_host")


def bf16(x) -> np.ndarray:
    """``x`` rounded to bf16, as fp32 (what a kernel reading bf16 sees)."""
    return bf16_to_float32(float32_to_bf16(np.asarray(x, np.float32)))


def compile_harness(source: Path, kernels: Path, binary: Path, defines: dict[str, int] | None = None) -> Path:
    """``source`` (a harness.cpp including the ``.cu`` files from ``kernels``) built into
    ``binary``; skips the test when there is no g++. Core's kernel folder comes after ``kernels``
    on the include path, as the CUDA loaders put it, so plugin kernels find ``common.cuh``."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("needs g++ to compile the kernels for the host")
    flags = [f"-D{name}={value}" for name, value in (defines or {}).items()]
    subprocess.run([compiler, "-std=c++20", "-O1", "-pthread", *flags, f"-I{HOST_INCLUDE}", f"-I{kernels}",
                    f"-I{kernel_include_dir()}", str(source), "-o", str(binary)], check=True)
    return binary


def run_harness(binary: Path, directory: Path, *args, timeout: float = 600, **arrays: np.ndarray) -> None:
    """Write each array to ``directory/NAME.bin`` and run ``binary directory *args``."""
    for name, array in arrays.items():
        np.ascontiguousarray(array).tofile(directory / f"{name}.bin")
    subprocess.run([str(binary), str(directory), *map(str, args)], check=True, timeout=timeout)


def read_array(directory: Path, name: str, dtype, shape) -> np.ndarray:
    """``directory/NAME.bin`` as ``dtype`` in ``shape``; bf16 (``np.uint16``) comes back as fp32."""
    raw = np.fromfile(directory / f"{name}.bin", dtype=dtype).reshape(shape)
    return bf16_to_float32(raw) if dtype == np.uint16 else raw
