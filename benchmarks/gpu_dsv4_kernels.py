"""DeepSeek-V4-Flash attention-side kernels on one GPU, against the HBM roofline.

For one layer of each kind (sliding only, CSA, HCA) at DeepSeek-V4-Flash shapes (hidden 4096, 64
heads, head_dim 512, rope 64, window 128, CSA rate 4 with 64 index heads × 128 and top-512, HCA
rate 128, hc 4) times the plugin's kernels (``openinfer_deepseek_v4.cuda_ops``) for a decode step
of batch 1 / 64 / 256 at context 4k / 64k, plus the mHC collapse + expand and one FP4 expert
(2048 × 4096, e2m1 + e8m0) at the same batches. Each time is set against its roofline: the bytes
the kernel must move (weights, cache rows it reads, activations in and out) over the measured
device copy bandwidth. The projections (cuBLAS) and the grouped MoE GEMM are not included: the
CUDA model forward that strings everything together is not written yet.

    python benchmarks/gpu_dsv4_kernels.py [--quick]

Writes benchmarks/results/gpu_dsv4_kernels.json and .png (and copies under $OUT when set).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
from gpu_bench import gpu_time  # benchmarks/ is on sys.path when this script runs

HEADS, HEAD_DIM, ROPE_DIM, WINDOW, HIDDEN, HC = 64, 512, 64, 128, 4096, 4
INDEX_HEADS, INDEX_DIM, INDEX_TOPK, CSA_RATE, HCA_RATE = 64, 128, 512, 4, 128
BLOCK = 64
RESULTS = Path(__file__).parent / "results"


def copy_bandwidth() -> float:
    import cupy

    src = cupy.random.random(2**28, dtype=cupy.float32)
    dst = cupy.empty_like(src)
    return 2 * src.nbytes / gpu_time(lambda: dst.__setitem__(Ellipsis, src))


def bf16_random(shape):
    import cupy

    return (cupy.random.standard_normal(shape, dtype=cupy.float32).view(cupy.uint32) >> 16).astype(cupy.uint16)


def paged_cache(batch: int, entries: int, width: int, live_from: int = 0):
    """A bf16 cache of ``entries`` rows per sequence and its block tables (sequences' blocks
    interleaved, as a shared pool hands them out); blocks wholly before ``live_from`` map to the
    null block 0, as the sliding window's freed blocks do."""
    import cupy

    blocks = -(-entries // BLOCK)
    first = live_from // BLOCK
    live = blocks - first
    tables = np.zeros((batch, blocks), np.int32)
    tables[:, first:] = np.arange(live)[None, :] * batch + np.arange(batch)[:, None] + 1
    return bf16_random(((1 + batch * live) * BLOCK, width)), cupy.asarray(tables)


def bench_attention(ops, kind: str, batch: int, context: int, bandwidth: float) -> dict:
    import cupy

    positions = cupy.full(batch, context - 1, np.int32)
    token_seq = cupy.arange(batch, dtype=np.int32)
    q = bf16_random((batch, HEADS, HEAD_DIM))
    sinks = cupy.zeros(HEADS, np.float32)
    inv_freq = cupy.asarray((1.0 / 160000.0 ** (np.arange(0, ROPE_DIM, 2) / ROPE_DIM)).astype(np.float32))
    window_cache, window_tables = paged_cache(batch, context, HEAD_DIM, live_from=context - WINDOW)
    rate = {"sliding": 1, "csa": CSA_RATE, "hca": HCA_RATE}[kind]
    entries = context // rate if kind != "sliding" else 0
    entry_cache = entry_tables = selected = None
    steps = []
    moved = batch * (2 * HEADS * HEAD_DIM * 2 + WINDOW * HEAD_DIM * 2)  # q + out + window keys
    if kind != "sliding":
        entry_cache, entry_tables = paged_cache(batch, entries, HEAD_DIM)
    if kind == "csa":
        index_q = bf16_random((batch, INDEX_HEADS, INDEX_DIM))
        weights = cupy.random.standard_normal((batch, INDEX_HEADS), dtype=cupy.float32)
        index_keys, index_tables = paged_cache(batch, entries, INDEX_DIM)
        _, selected = ops.indexer_topk(index_q, weights, index_keys, index_tables, BLOCK, token_seq, positions,
                                       rate, entries, INDEX_TOPK)
        steps.append(lambda: ops.indexer_topk(index_q, weights, index_keys, index_tables, BLOCK, token_seq, positions,
                                              rate, entries, INDEX_TOPK))
        moved += batch * (entries * INDEX_DIM * 2 + INDEX_HEADS * INDEX_DIM * 2 + min(entries, INDEX_TOPK) * HEAD_DIM * 2)
    elif kind == "hca":
        moved += batch * entries * HEAD_DIM * 2
    steps.append(lambda: ops.sparse_attention(q, window_cache, window_tables, entry_cache, entry_tables, selected, rate,
                                              token_seq, positions, sinks, inv_freq, ROPE_DIM, WINDOW, BLOCK))
    seconds = gpu_time(lambda: [step() for step in steps])
    return {"op": f"attention/{kind}", "batch": batch, "context": context, "seconds": seconds,
            "bytes": moved, "roofline_seconds": moved / bandwidth, "roofline_fraction": moved / bandwidth / seconds}


def bench_mhc(ops, batch: int, bandwidth: float) -> dict:
    import cupy

    streams = cupy.random.standard_normal((batch, HC, HIDDEN), dtype=cupy.float32)
    fn = cupy.random.standard_normal(((2 + HC) * HC, HC * HIDDEN), dtype=cupy.float32) * 0.01
    base = cupy.zeros((2 + HC) * HC, np.float32)
    scale = cupy.ones(3, np.float32)
    y = bf16_random((batch, HIDDEN))

    def step():
        _, post, comb = ops.hc_collapse(streams, fn, base, scale, sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6)
        ops.hc_expand(streams, y, post, comb, out=streams)

    moved = fn.nbytes + batch * (3 * streams[0].nbytes + 2 * HIDDEN * 2)
    seconds = gpu_time(step)
    return {"op": "mhc collapse+expand", "batch": batch, "context": 0, "seconds": seconds, "bytes": moved,
            "roofline_seconds": moved / bandwidth, "roofline_fraction": moved / bandwidth / seconds}


def bench_fp4_expert(ops, batch: int, bandwidth: float) -> dict:
    import cupy

    from openinfer.quant import quantize_fp4_e2m1

    codes, scales = quantize_fp4_e2m1(np.random.default_rng(0).standard_normal((2048, HIDDEN)).astype(np.float32))
    codes, scales = cupy.asarray(codes), cupy.asarray(scales)
    x = bf16_random((batch, HIDDEN))
    seconds = gpu_time(lambda: ops.quantized_linear(x, codes, scales, 2048, "fp4"))
    moved = codes.nbytes + scales.nbytes + batch * (HIDDEN + 2048) * 2
    return {"op": "fp4 expert w1 (2048x4096)", "batch": batch, "context": 0, "seconds": seconds, "bytes": moved,
            "roofline_seconds": moved / bandwidth, "roofline_fraction": moved / bandwidth / seconds}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['op']}\nb{r['batch']} c{r['context'] // 1024}k" if r["context"] else f"{r['op']}\nb{r['batch']}"
              for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, 0.5 * len(rows)), 4))
    ax.bar(range(len(rows)), [100 * r["roofline_fraction"] for r in rows])
    ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=6)
    ax.set_ylabel("% of HBM roofline")
    ax.set_title("DeepSeek-V4-Flash kernels (one layer of each kind)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batch 1 and 64, context 4k only")
    args = parser.parse_args()
    import cupy
    from openinfer_deepseek_v4 import cuda_ops

    batches = [1, 64] if args.quick else [1, 64, 256]
    contexts = [4096] if args.quick else [4096, 65536]
    bandwidth = copy_bandwidth()
    rows = []
    for kind in ("sliding", "csa", "hca"):
        for batch in batches:
            for context in contexts:
                rows.append(bench_attention(cuda_ops, kind, batch, context, bandwidth))
                print(json.dumps(rows[-1]), flush=True)
    for batch in batches:
        rows += [bench_mhc(cuda_ops, batch, bandwidth), bench_fp4_expert(cuda_ops, batch, bandwidth)]
        print(json.dumps(rows[-2:]), flush=True)
    report = {"gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "cupy": cupy.__version__,
              "copy_bandwidth_bytes_per_s": bandwidth, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "gpu_dsv4_kernels.json"
    out.write_text(json.dumps(report, indent=1))
    plot(rows, out.with_suffix(".png"))
    if os.environ.get("OUT"):
        for path in (out, out.with_suffix(".png")):
            shutil.copy(path, Path(os.environ["OUT"]) / path.name)


if __name__ == "__main__":
    main()
