"""Kernel variants on Qwen3-4B decode shapes, to pick compile-time tuning by measurement.

decode attention (GQA 32/8, head_dim 128, paged bf16 KV): the tensor-core kernel's warps x
pipeline stages variants at batch 1/16/64/256 and context 1k/4k, with the CUDA-core kernel as the
baseline, and its split counts on equal and ragged (uniform 1..2x) context lengths; bandwidth = KV bytes read / time (CUDA graph of 8 calls over
different KV regions). Skinny GEMM at M=1 (GEMV_M1_UNROLL variants) and cuBLAS at M=1 on every
Qwen3-4B projection, bandwidth = weight bytes / time. Writes
benchmarks/results/gpu_kernel_variants.json (and $OUT when set).

    python benchmarks/gpu_kernel_variants.py [--decode-attention-only]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from gpu_bench import gpu_time  # noqa: E402
from gpu_decode_attention import KVPool, graph_seconds_per_call, random_bf16  # noqa: E402

# (warps, stages) of decode_attention_mma.cu; shared memory = warps * stages * 8 KiB at head_dim 128
MMA_VARIANTS = [(4, 2), (4, 3), (8, 2)]
DECODE_SHAPES = [(1, 4096), (16, 4096), (64, 1024), (256, 1024)]
SPLIT_SWEEP = [(1, 4096), (4, 4096), (16, 1024), (64, 1024), (256, 1024)]
SHAPES = {"qkv": (6144, 2560), "o_proj": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728),
          "lm_head": (151936, 2560)}


def decode_attention_variants(num_sms: int) -> list[dict]:
    import cupy

    from openinfer.backend.cuda.decode_attention import decode_attention_mma, decode_attention_split

    nh, nkv, d = 32, 8, 128
    pool = KVPool(max(b * c for b, c in DECODE_SHAPES + SPLIT_SWEEP) * 2, nkv, d)
    rng = np.random.default_rng(0)
    rows = []

    def measure(lengths: np.ndarray, label: dict, launch) -> None:
        batch = len(lengths)
        tables = pool.tables(batch, int(lengths.max()))
        lens = cupy.asarray(lengths.astype(np.int32))
        queries = [random_bf16((batch, nh, d)) for _ in tables]
        calls = [lambda q=q, t=t: launch(q, pool.k, pool.v, t, lens, d**-0.5, num_sms)
                 for q, t in zip(queries, tables, strict=True)]
        seconds = graph_seconds_per_call(calls)
        kv_bytes = 2 * int(lengths.sum()) * nkv * d * 2
        row = {"batch_size": batch, "context": int(lengths.mean()), **label, "us": seconds * 1e6,
               "gb_per_s": kv_bytes / seconds / 1e9}
        rows.append(row)
        print(f"decode attn bs={batch} ctx={row['context']} {label}: {row['us']:.1f} us, {row['gb_per_s']:.0f} GB/s",
              flush=True)

    for batch, context in DECODE_SHAPES:
        lengths = np.full(batch, context)
        measure(lengths, {"kernel": "split"}, decode_attention_split)
        for warps, stages in MMA_VARIANTS:
            measure(lengths, {"kernel": "mma", "warps": warps, "stages": stages},
                    lambda *a, warps=warps, stages=stages: decode_attention_mma(*a, warps=warps, stages=stages))
    for batch, context in SPLIT_SWEEP:
        for ragged in (False, True):  # ragged: lengths uniform in 1 .. 2 x context
            lengths = rng.integers(1, 2 * context, batch) if ragged else np.full(batch, context)
            for splits in (1, 2, 3, 4, 8, 16, 32):
                measure(lengths, {"kernel": "mma", "splits": splits, "ragged": ragged},
                        lambda *a, splits=splits: decode_attention_mma(*a, splits=splits))
    return rows


def main() -> None:
    import cupy

    from openinfer.backend.cuda import CudaBackend
    from openinfer.backend.cuda.linear import CudaLinear
    from openinfer.backend.cuda.loader import kernel

    backend = CudaBackend()
    report = {"gpu": backend.device_name, "decode_attention": decode_attention_variants(backend.num_sms),
              "gemv_m1": []}
    cupy.get_default_memory_pool().free_all_blocks()
    shapes = {} if "--decode-attention-only" in sys.argv[1:] else SHAPES
    x = backend.upload(np.random.default_rng(0).standard_normal((1, 9728), np.float32))
    for name, (n, kk) in shapes.items():
        w = (cupy.random.standard_normal((n, kk), dtype=cupy.float32).view(cupy.uint32) >> 16).astype(cupy.uint16)
        layer = CudaLinear(w, None)
        xin = x[:, :kk].copy()
        y = cupy.empty((1, n), dtype=cupy.uint16)
        for unroll in (4, 8):
            fn = kernel("gemv.cu", "gemv_m1", GEMV_M1_UNROLL=unroll)
            grid = (n + 7) // 8
            seconds = gpu_time(lambda fn=fn, grid=grid, xin=xin, layer=layer, y=y, n=n, kk=kk: fn(
                (grid,), (256,), (xin, layer.weight, np.uint64(0), y, np.int32(1), np.int32(n), np.int32(kk))), repeat=30)
            report["gemv_m1"].append({"shape": name, "impl": f"gemv unroll {unroll}", "us": seconds * 1e6,
                                      "gb_per_s": w.nbytes / seconds / 1e9})
        seconds = gpu_time(lambda xin=xin, w=w, y=y: backend.blas.matmul_nt(xin, w, y), repeat=30)
        report["gemv_m1"].append({"shape": name, "impl": "cublas", "us": seconds * 1e6, "gb_per_s": w.nbytes / seconds / 1e9})
        for row in report["gemv_m1"][-3:]:
            print(f"M=1 {name} {row['impl']}: {row['us']:.1f} us, {row['gb_per_s']:.0f} GB/s", flush=True)
    for out in [Path(__file__).parent / "results"] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else []):
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_kernel_variants.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
