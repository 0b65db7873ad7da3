"""CPU CI for gemv.cu's programmatic-dependent-launch build (DECODE_PDL=1: core's $OPENINFER_GEMV_PDL and
$OPENINFER_DECODE_PDL): in the sm_90a SASS the one-row GEMVs issue their first pass of 16-byte weight loads BEFORE
griddepcontrol.wait (ACQBULK), so a weight stream starts while the previous kernel finishes. With plain loads ptxas
scheduled ACQBULK above every weight load (decode_pdl.cuh decode_pdl_load_early says why); the plain build has no
griddepcontrol at all. The two PDL GEMVs stay at 48 registers (5 blocks an SM, as plain). Needs nvcc and cuobjdump (skipped without)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

KERNEL_DIR = Path(__file__).resolve().parents[2] / "core" / "kernels"
FIRST_PASS = {"gemv_m1": 8, "gemv_m1_rms_scaled": 6}  # gemv.cu GEMV_M1_UNROLL, RMS_SCALED_UNROLL


def sass(tmp_path: Path, pdl: int) -> tuple[dict[str, list[str]], dict[str, int]]:
    """gemv.cu built for sm_90a with DECODE_PDL=``pdl``: each kernel's load / griddepcontrol instructions in order,
    and its registers (ptxas -v)."""
    nvcc, cuobjdump = shutil.which("nvcc"), shutil.which("cuobjdump")
    if nvcc is None or cuobjdump is None:
        pytest.skip("nvcc and cuobjdump needed")
    cubin = tmp_path / f"gemv{pdl}.cubin"
    build = subprocess.run([nvcc, "-arch=sm_90a", "-std=c++17", f"-I{KERNEL_DIR}", f"-DDECODE_PDL={pdl}", "-Xptxas",
                            "-v", "-cubin", str(KERNEL_DIR / "gemv.cu"), "-o", str(cubin)], check=True,
                           capture_output=True, text=True, timeout=300)
    registers = {name: int(used) for name, used in re.findall(
        r"Compiling entry function '(\w+)'.*?Used (\d+) registers", build.stderr, re.S)}
    text = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    kernels, name = {}, None
    for line in text.splitlines():
        found = re.search(r"Function : (\w+)", line)
        if found:
            name = found.group(1)
            kernels[name] = []
        elif name is not None:
            op = re.search(r"\b(LDG\.E\.128[\w.]*|ACQBULK|PREEXIT)\b", line)
            if op:
                kernels[name].append(op.group(1))
    return kernels, registers


def test_pdl_gemvs_load_weights_before_the_wait(tmp_path):
    kernels, registers = sass(tmp_path, 1)
    for name, unroll in FIRST_PASS.items():
        assert registers[name] <= 48, registers  # 5 blocks of 256 threads an SM, as the plain build
        ops = kernels[name]
        wait = ops.index("ACQBULK")
        early = [op for op in ops[:wait] if op.startswith("LDG.E.128")]
        assert len(early) == unroll, (name, ops[:wait + 2])
        assert ops[wait + 1] == "PREEXIT", (name, ops[wait:wait + 2])  # launch_dependents right after the wait


def test_plain_build_has_no_griddepcontrol(tmp_path):
    for name, ops in sass(tmp_path, 0)[0].items():
        assert "ACQBULK" not in ops and "PREEXIT" not in ops, name
