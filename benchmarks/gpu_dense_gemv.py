"""gemv.cu's bf16 decode GEMVs (one row: ``gemv_m1`` and the fused ``gemv_m1_add_rms_norm`` /
``gemv_m1_silu_mul``) at the dense projections of Kimi-K2, Moonlight-16B-A3B and Qwen3-4B, by
compile-time variant of gemv.cu (``GEMV_BATCHED_TAIL`` 1: the last partial pass issues all its
loads first; 0: one load at a time). Each call is timed inside a CUDA graph
of calls on rotating weight copies (at least 256 MB of them, so L2 never holds a weight), against
the bytes it must read over the measured copy bandwidth. JSON + PNG into benchmarks/results/ and $OUT.

    python benchmarks/gpu_dense_gemv.py [--shapes kimi,moonlight,qwen3] [--variants batched_tail,cols2] [--name ...]
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

# (name, out_features N, in_features K, kernel): kernel "plain" gemv_m1, "norm" the RMSNorm-fused
# one (as add_rms_norm_linear runs q_a_norm + q_b with fuse_decode), "norm_two" rms_norm then gemv_m1 (what it
# runs by default), "norm_scaled" gemv_m1_rms_scaled (OPENINFER_RMS_SCALED_GEMV=1), "silu" the SiLU·mul-fused
# one (K = I, input 2I)
SHAPES: dict[str, list[tuple[str, int, int, str]]] = {
    "kimi": [("qkv_a", 2112, 7168, "plain"), ("q_b", 12288, 1536, "plain"), ("q_a_norm+q_b", 12288, 1536, "norm"),
             ("q_a_norm+q_b two launches", 12288, 1536, "norm_two"),
             ("q_a_norm+q_b scaled", 12288, 1536, "norm_scaled"),
             ("o_proj", 7168, 8192, "plain"),
             ("shared gate_up", 4096, 7168, "plain"), ("shared silu+down", 7168, 2048, "silu")],
    "moonlight": [("q+kv_a", 3648, 2048, "plain"), ("o_proj", 2048, 2048, "plain"),
                  ("shared gate_up", 5632, 2048, "plain"), ("shared silu+down", 2048, 2816, "silu"),
                  ("dense silu+down", 2048, 11264, "silu"), ("lm_head", 163840, 2048, "plain")],
    "qwen3": [("qkv", 6144, 2560, "norm"), ("o_proj", 2560, 4096, "plain"), ("gate_up", 19456, 2560, "norm"),
              ("silu+down", 2560, 9728, "silu"), ("lm_head", 151936, 2560, "plain")],
}
# (gemv_m1_cols / gemv_m1_ksplit / gemv_m1_deep, separate kernels slower at every Kimi-K2 shape in 2026-11-24's D2 and
# s12's D2b, are gone: dense_gemv_int4d_d2_h200.json, kimi_layer_b1_kimi13_d2b; so is gemv_m1_pipelined, the next pass's
# loads in flight while a pass multiplies: s13 D2, dense_gemv_int4_s13d1_h200.json, qkv_a 9.6 -> 13.1, o_proj 29.5 ->
# 41.0 us. gemv_m1's GEMV_M1_COLS of s15, below as cols2 / cols4, keeps 8 loads a lane in flight; core takes it past a
# wave of blocks and beside other work: linear.GEMV_M1_COLS_ENV.)
# unroll4 / 6 / 12: gemv_m1's pass of GEMV_M1_UNROLL 16-byte loads a lane (default 8) shorter or longer (bits of the
# default: each lane's k in order)
VARIANTS = {"batched_tail": {"GEMV_BATCHED_TAIL": 1}, "serial_tail": {"GEMV_BATCHED_TAIL": 0},
            "unroll4": {"GEMV_BATCHED_TAIL": 1, "GEMV_M1_UNROLL": 4}, "unroll6": {"GEMV_BATCHED_TAIL": 1, "GEMV_M1_UNROLL": 6},
            "unroll12": {"GEMV_BATCHED_TAIL": 1, "GEMV_M1_UNROLL": 12},
            # gemv_m1's warps owning 2 / 4 columns (GEMV_M1_COLS, core's $OPENINFER_GEMV_M1_COLS; the fused kernels as
            # batched_tail)
            "cols2": {"GEMV_BATCHED_TAIL": 1, "GEMV_M1_COLS": 2}, "cols4": {"GEMV_BATCHED_TAIL": 1, "GEMV_M1_COLS": 4}}
DEFAULT_VARIANTS = "batched_tail,serial_tail"
CALLS = 16  # calls per timed graph
MIN_ROTATION_BYTES = 256 << 20


def launcher(kind: str, n: int, k: int, defines: dict[str, int], num_sms: int):
    """A closure ``(x, w, out) -> None`` launching ``kind`` as the CUDA backend does (linear.py)."""
    import cupy

    from openinfer.backend.cuda.linear import FUSED_LAUNCH, GEMV_WARPS_PER_BLOCK, fused_grid
    from openinfer.backend.cuda.loader import kernel

    null = np.uint64(0)
    threads = (GEMV_WARPS_PER_BLOCK * 32,)
    if kind == "plain":
        fn = kernel("gemv.cu", "gemv_m1", **defines)
        grid = (-(-n // (GEMV_WARPS_PER_BLOCK * defines.get("GEMV_M1_COLS", 1))),)
        return lambda x, w, out: fn(grid, threads, (x, w, null, out, np.int32(1), np.int32(n), np.int32(k)))
    norm = cupy.ones(k, cupy.uint16) * np.uint16(0x3F80)  # bf16 1.0
    if kind == "norm_scaled":
        fn = kernel("gemv.cu", "gemv_m1_rms_scaled", **defines)
        grid = (-(-n // GEMV_WARPS_PER_BLOCK),)
        return lambda x, w, out: fn(grid, threads, (x, norm, np.float32(1e-6), w, null, out, np.int32(n), np.int32(k)))
    if kind == "norm_two":  # the CUDA backend's rms_norm (its kernel for the row), then gemv_m1
        from openinfer.backend.cuda import CudaBackend

        backend = CudaBackend()
        fn = kernel("gemv.cu", "gemv_m1", **defines)
        grid = (-(-n // (GEMV_WARPS_PER_BLOCK * defines.get("GEMV_M1_COLS", 1))),)
        return lambda x, w, out: fn(grid, threads, (backend.rms_norm(x, norm, 1e-6), w, null, out, np.int32(1),
                                                    np.int32(n), np.int32(k)))
    grid = (fused_grid(n, num_sms, FUSED_LAUNCH.blocks_per_sm),)
    prefetch = np.int32(FUSED_LAUNCH.prefetch_bytes)
    if kind == "norm":
        fn = kernel("gemv.cu", "gemv_m1_add_rms_norm", **defines)
        threads_norm = np.int32(min(1024, max(32, -(-k // 32) * 32 // 2)))
        return lambda x, w, out: fn(grid, threads, (x, null, norm, np.float32(1e-6), threads_norm, w, null, out, null,
                                                    np.int32(n), np.int32(k), prefetch), shared_mem=2 * k)
    fn = kernel("gemv.cu", "gemv_m1_silu_mul", **defines)
    return lambda x, w, out: fn(grid, threads, (x, w, null, out, np.int32(n), np.int32(k), prefetch), shared_mem=2 * k)


def run(args) -> dict:
    import cupy
    from gpu_kimi import copy_bandwidth, device_name, graph_call_seconds

    from openinfer import float32_to_bf16

    num_sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    bandwidth = copy_bandwidth()
    rng = np.random.default_rng(0)
    points = []
    for model in args.shapes.split(","):
        if model not in SHAPES:
            raise SystemExit(f"--shapes: unknown {model!r}; one of {', '.join(SHAPES)}")
        for name, n, k, kind in SHAPES[model]:
            weight_bytes = n * k * 2
            copies = max(2, min(CALLS, -(-MIN_ROTATION_BYTES // weight_bytes)))
            first_copy = cupy.asarray(float32_to_bf16(0.02 * rng.standard_normal((n, k), np.float32)))
            weights = [first_copy] + [first_copy.copy() for _ in range(copies - 1)]  # the same values: L2 cannot tell
            width = 2 * k if kind == "silu" else k
            x = cupy.asarray(float32_to_bf16(rng.standard_normal((1, width), np.float32)))
            point = {"model": model, "op": name, "kernel": kind, "N": n, "K": k, "bytes": weight_bytes,
                     "weight_copies": copies}
            outputs = {}
            variants = {v: VARIANTS[v] for v in args.variants.split(",")}
            for variant, defines in variants.items():
                launch = launcher(kind, n, k, defines, num_sms)
                outs = [cupy.empty((1, n), cupy.uint16) for _ in range(CALLS)]
                calls = [partial(launch, x, weights[i % copies], outs[i]) for i in range(CALLS)]
                seconds, error = graph_call_seconds(calls)
                cupy.cuda.Device().synchronize()
                outputs[variant] = cupy.asnumpy(outs[0])
                point[f"{variant}_us"] = 1e6 * seconds
                point[f"{variant}_fraction_of_copy_bandwidth"] = weight_bytes / seconds / bandwidth
                if error:
                    point[f"{variant}_graph_error"] = error
            first = next(iter(variants))
            for variant in list(variants)[1:]:
                point[f"{variant}_speedup"] = point[f"{first}_us"] / point[f"{variant}_us"]
                point[f"{variant}_bits_equal"] = bool(np.array_equal(outputs[first], outputs[variant]))
            point["bits_equal"] = bool(all(np.array_equal(outputs[first], o) for o in outputs.values()))
            print(json.dumps(point), flush=True)
            points.append(point)
            del weights
            cupy.get_default_memory_pool().free_all_blocks()
    return {"benchmark": "dense_gemv", "device": device_name(), "copy_bandwidth_gbs": bandwidth / 1e9,
            "variants": {v: VARIANTS[v] for v in args.variants.split(",")}, "points": points}


def plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    points = report["points"]
    labels = [f"{p['model']}\n{p['op']}" for p in points]
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(points)), 4.5))
    width = 0.8 / len(report["variants"])
    for i, variant in enumerate(report["variants"]):
        ax.bar(np.arange(len(points)) + i * width, [100 * p.get(f"{variant}_fraction_of_copy_bandwidth", 0.0)
                                                     for p in points],
               width, label=variant)
    ax.set_xticks(np.arange(len(points)) + width * (len(report["variants"]) - 1) / 2, labels, fontsize=7)
    ax.set_ylabel("% of copy bandwidth")
    ax.set_title(f"gemv.cu decode GEMVs, one row ({report['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--name", default="dense_gemv", help="results file name (JSON + PNG)")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help=f"comma list of {', '.join(VARIANTS)} (the first the reference)")
    args = parser.parse_args()
    if not args.variants or set(args.variants.split(",")) - set(VARIANTS):
        raise SystemExit(f"--variants {args.variants!r}: want a comma list of {', '.join(VARIANTS)}")
    RESULTS.mkdir(exist_ok=True)
    report = run(args)
    report["time"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    (RESULTS / f"{args.name}.json").write_text(json.dumps(report, indent=2))
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    if out is not None:
        shutil.copy(RESULTS / f"{args.name}.json", out / f"{args.name}.json")
    plot(report, RESULTS / f"{args.name}.png")
    if out is not None and (RESULTS / f"{args.name}.png").exists():
        shutil.copy(RESULTS / f"{args.name}.png", out / f"{args.name}.png")


if __name__ == "__main__":
    main()
