"""Kernel variants on Qwen3-4B decode shapes, to pick compile-time tuning by measurement.

decode attention (split-KV, GQA 32/8, head_dim 128, context 512): UNROLL x MIN_BLOCKS variants,
bandwidth = KV bytes read / time; skinny GEMM at M=1 (GEMV_M1_UNROLL variants) and cuBLAS at
M=1 on every Qwen3-4B projection, bandwidth = weight bytes / time. Writes
benchmarks/results/gpu_kernel_variants.json (and $OUT when set).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from gpu_bench import gpu_time  # noqa: E402

DECODE_VARIANTS = [dict(UNROLL=4, MIN_BLOCKS=1), dict(UNROLL=2, MIN_BLOCKS=4), dict(UNROLL=4, MIN_BLOCKS=2),
                   dict(UNROLL=2, MIN_BLOCKS=2), dict(UNROLL=8, MIN_BLOCKS=2), dict(UNROLL=8, MIN_BLOCKS=1)]
SHAPES = {"qkv": (6144, 2560), "o_proj": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728),
          "lm_head": (151936, 2560)}


def main() -> None:
    import cupy

    from openinfer.backend.cuda import CudaBackend
    from openinfer.backend.cuda.attention import LOG2E, decode_splits
    from openinfer.backend.cuda.linear import CudaLinear
    from openinfer.backend.cuda.loader import kernel

    backend = CudaBackend()
    report = {"gpu": backend.device_name, "decode_attention": [], "gemv_m1": []}
    nh, nkv, d, ctx, bs_list = 32, 8, 128, 512, (64, 256)
    for bs in bs_list:
        blocks = ctx // 16
        num_blocks = 1 + bs * blocks
        k = (cupy.random.standard_normal((num_blocks, 16, nkv, d), dtype=cupy.float32).view(cupy.uint32) >> 16).astype(cupy.uint16)
        v = k.copy()
        tables = cupy.asarray((1 + np.arange(bs * blocks, dtype=np.int32)).reshape(bs, blocks))
        lens = cupy.full(bs, ctx, dtype=cupy.int32)
        q = (cupy.random.standard_normal((bs, nh, d), dtype=cupy.float32).view(cupy.uint32) >> 16).astype(cupy.uint16)
        splits = decode_splits(bs, nkv, backend.num_sms)
        part_o = cupy.empty((bs, nh, splits, d), dtype=cupy.float32)
        part_ml = cupy.empty((bs, nh, splits, 2), dtype=cupy.float32)
        out = cupy.empty((bs, nh * d), dtype=cupy.uint16)
        kv_bytes = 2 * bs * ctx * nkv * d * 2
        for variant in DECODE_VARIANTS:
            split_fn = kernel("decode_attention.cu", "decode_attention_split", HEAD_DIM=d, GROUP=nh // nkv, **variant)
            combine = kernel("decode_attention.cu", "decode_attention_combine", HEAD_DIM=d, GROUP=nh // nkv, **variant)

            split_args = (q, k, v, tables, np.int32(blocks), lens, part_o, part_ml, np.int32(nkv), np.int32(16),
                          np.int32(splits), np.float32(d**-0.5 * LOG2E))
            combine_args = (part_o, part_ml, out, np.int32(nh), np.int32(splits))

            def run(split_fn=split_fn, combine=combine, grids=((splits, nkv, bs), (nh, bs)),
                    split_args=split_args, combine_args=combine_args):
                split_fn(grids[0], (128,), split_args)
                combine(grids[1], (128,), combine_args)

            seconds = gpu_time(run, repeat=20)
            row = {"batch_size": bs, **variant, "us": seconds * 1e6, "gb_per_s": kv_bytes / seconds / 1e9}
            report["decode_attention"].append(row)
            print(f"decode attn bs={bs} {variant}: {row['us']:.1f} us, {row['gb_per_s']:.0f} GB/s", flush=True)
    x = backend.upload(np.random.default_rng(0).standard_normal((1, 9728), np.float32))
    for name, (n, kk) in SHAPES.items():
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
