"""Decode-sized dense GEMMs (2-64 rows): cuBLAS against moe_sm90.cu's Hopper grouped GEMM run as one
expert (``OPENINFER_SKINNY_SM90``, core's ``linear.skinny_sm90``), at the dense projections of
Moonlight-16B-A3B, Qwen3-4B and Kimi-K2 (``gpu_dense_gemv.SHAPES``; the fused GEMVs' norm / SiLU
not included: the plain product of the same weight). Each call is timed inside a CUDA graph of calls
on rotating weight copies (at least 256 MB of them, so L2 never holds a weight), against the bytes it
must read over the measured copy bandwidth; each method's output is checked against cuBLAS's.
JSON + PNG into benchmarks/results/ and $OUT.

    python benchmarks/gpu_skinny_gemm.py [--shapes moonlight,qwen3,kimi] [--rows 2,4,8,16,32,64]
        [--methods cublas,m64_n128_k2_sk,m64_n128_k2] [--name skinny_gemm]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

CALLS = 16  # calls per timed graph
MIN_ROTATION_BYTES = 256 << 20
DEFAULT_METHODS = "cublas,m64_n128_k2_sk,m64_n128_k2,m64_s5_sk"


def method_call(method: str, blas, x, layer, out):
    """A closure running one GEMM by ``method`` ("cublas", else a moe_sm90 tile shape)."""
    from openinfer.backend.cuda.linear import skinny_sm90

    if method == "cublas":
        return partial(blas.matmul_nt, x, layer.weight, out)

    def call():
        result = skinny_sm90(x, layer, method)
        if result is None:
            raise RuntimeError(f"skinny_sm90 declined {tuple(x.shape)} x {tuple(layer.weight.shape)}")
        out[...] = result  # an extra copy of [M, N] (tiny next to the weight): the graph keeps one output per call

    return call


def run(args) -> dict:
    import cupy
    from gpu_dense_gemv import SHAPES
    from gpu_kimi import copy_bandwidth, device_name, graph_call_seconds

    from openinfer import bf16_to_float32, float32_to_bf16
    from openinfer.backend.cuda.cublas import Cublas
    from openinfer.backend.cuda.linear import CudaLinear

    blas = Cublas()
    bandwidth = copy_bandwidth()
    rng = np.random.default_rng(0)
    methods = args.methods.split(",")
    rows_list = [int(r) for r in args.rows.split(",")]
    points = []
    for model in args.shapes.split(","):
        if model not in SHAPES:
            raise SystemExit(f"--shapes: unknown {model!r}; one of {', '.join(SHAPES)}")
        for name, n, k, kind in SHAPES[model]:
            if name == "lm_head":
                continue
            if kind == "silu":
                name = name.replace("silu+", "")
            weight_bytes = n * k * 2
            copies = max(2, min(CALLS, -(-MIN_ROTATION_BYTES // weight_bytes)))
            first = cupy.asarray(float32_to_bf16(0.02 * rng.standard_normal((n, k), np.float32)))
            layers = [CudaLinear(first, None)] + [CudaLinear(first.copy(), None) for _ in range(copies - 1)]
            for rows in rows_list:
                x = cupy.asarray(float32_to_bf16(rng.standard_normal((rows, k), np.float32)))
                point = {"model": model, "op": name, "N": n, "K": k, "rows": rows, "bytes": weight_bytes,
                         "weight_copies": copies}
                reference = None
                for method in methods:
                    outs = [cupy.empty((rows, n), cupy.uint16) for _ in range(CALLS)]
                    calls = [method_call(method, blas, x, layers[i % copies], outs[i]) for i in range(CALLS)]
                    try:
                        seconds, error = graph_call_seconds(calls)
                    except Exception as exc:  # noqa: BLE001 - reported in the JSON
                        point[f"{method}_error"] = f"{type(exc).__name__}: {exc}"
                        continue
                    cupy.cuda.Device().synchronize()
                    result = bf16_to_float32(cupy.asnumpy(outs[0]))
                    if reference is None:
                        reference = result
                    point[f"{method}_us"] = 1e6 * seconds
                    point[f"{method}_fraction_of_copy_bandwidth"] = weight_bytes / seconds / bandwidth
                    point[f"{method}_max_rel_difference"] = float(
                        np.abs(result - reference).max() / max(1e-30, float(np.abs(reference).max())))
                    if error:
                        point[f"{method}_graph_error"] = error
                print(json.dumps(point), flush=True)
                points.append(point)
            del layers
            cupy.get_default_memory_pool().free_all_blocks()
    return {"benchmark": "skinny_gemm", "device": device_name(), "copy_bandwidth_gbs": bandwidth / 1e9,
            "methods": methods, "rows": rows_list, "points": points}


def plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ops = sorted({(p["model"], p["op"]) for p in report["points"]}, key=lambda o: [p["model"] for p in report["points"]].index(o[0]))
    fig, axes = plt.subplots(1, len(ops), figsize=(3.2 * len(ops), 3.6), sharey=True, squeeze=False)
    for ax, (model, op) in zip(axes[0], ops, strict=True):
        points = [p for p in report["points"] if (p["model"], p["op"]) == (model, op)]
        for method in report["methods"]:
            xs = [p["rows"] for p in points if f"{method}_us" in p]
            ax.plot(xs, [100 * p[f"{method}_fraction_of_copy_bandwidth"] for p in points if f"{method}_us" in p],
                    marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{model} {op}\n{points[0]['N']}x{points[0]['K']}", fontsize=8)
        ax.set_xlabel("rows")
    axes[0][0].set_ylabel("% of copy bandwidth")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"decode-sized dense GEMMs: cuBLAS vs moe_sm90 as one expert ({report['device']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="moonlight,qwen3,kimi", help="comma list of gpu_dense_gemv's shape sets")
    parser.add_argument("--rows", default="2,4,8,16,32,64")
    parser.add_argument("--methods", default=DEFAULT_METHODS, help="cublas and moe_sm90 tile shapes")
    parser.add_argument("--name", default="skinny_gemm", help="results file name (JSON + PNG)")
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    report = run(args)
    report["time"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    (RESULTS / f"{args.name}.json").write_text(json.dumps(report, indent=2))
    plot(report, RESULTS / f"{args.name}.png")
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    if out is not None:
        for suffix in (".json", ".png"):
            if (RESULTS / f"{args.name}{suffix}").exists():
                shutil.copy(RESULTS / f"{args.name}{suffix}", out / f"{args.name}{suffix}")


if __name__ == "__main__":
    main()
