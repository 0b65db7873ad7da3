"""GPU benchmark: decode attention, the CUDA-core ``split`` kernel against the tensor-core ``mma``
kernel, side by side in one run (openinfer.backend.cuda.decode_attention).

  ceiling    device copy bandwidth (bytes read + written, 2 GiB buffers);
  attention  Qwen3-4B's decode attention (32 query heads, 8 KV heads, head_dim 128, paged bf16 KV,
             block 16) at batch 1/16/64/128/256 x context 512/1k/4k, and ragged batches (lengths
             uniform in 1..2k): time per call (CUDA graph of 8 calls over different KV regions,
             so small shapes do not run from L2), effective GB/s = (KV + q + out bytes) / time,
             and its fraction of the copy bandwidth (a read-only stream can pass 100 %: the copy
             both reads and writes);
  step       the whole Qwen3-4B decode step (random bf16 weights, 36 layers, context 1024) at
             batch 1, 64 and 256, one CUDA graph captured with each kernel, replays interleaved.
Writes benchmarks/results/gpu_decode_attention.json and .png (and copies under $OUT when set).

    python benchmarks/gpu_decode_attention.py [--quick] [--no-step]
    python benchmarks/gpu_decode_attention.py --plot benchmarks/results/gpu_decode_attention.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from gpu_bench import BLOCK_SIZE, QWEN3_4B, decode_batch  # noqa: E402

BATCHES = (1, 16, 64, 128, 256)
CONTEXTS = (512, 1024, 4096)
STEP_BATCHES = (1, 64, 256)
STEP_CONTEXT = 1024
CALLS_PER_GRAPH = 8
KERNELS = ("split", "mma")
RESULTS = Path(__file__).parent / "results"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def random_bf16(shape: tuple[int, ...], scale: float = 1.0):
    """Random normal bf16 bits on the device (never zeros: they can time faster than data)."""
    import cupy

    x = cupy.random.standard_normal(shape, dtype=cupy.float32)
    if scale != 1.0:
        x *= scale
    return (x.view(cupy.uint32) >> 16).astype(cupy.uint16)


def copy_bandwidth() -> float:
    import cupy

    from openinfer.tools.ledger import gpu_seconds

    src = cupy.random.random(2**29, dtype=cupy.float32)  # 2 GiB
    dst = cupy.empty_like(src)
    seconds = gpu_seconds(lambda: dst.__setitem__(Ellipsis, src), 20, 3)
    return 2 * src.nbytes / seconds


def graph_seconds_per_call(calls, repeats: int = 20) -> float:
    """Capture ``calls`` (callables, each one kernel call) in one CUDA graph on a private pool and
    return the median replay time divided by the number of calls."""
    import cupy

    from openinfer.tools.ledger import gpu_seconds

    pool, stream = cupy.cuda.MemoryPool(), cupy.cuda.Stream(non_blocking=True)
    with cupy.cuda.using_allocator(pool.malloc), stream:
        for call in calls:  # compiles, sets shared-memory limits, fills the pool
            call()
        stream.synchronize()
        stream.begin_capture()
        for call in calls:
            call()
        graph = stream.end_capture()
        seconds = gpu_seconds(lambda: graph.launch(stream), repeats, 3)
    return seconds / len(calls)


class KVPool:
    """One layer's paged K/V big enough for the largest shape; block tables for a shape are laid
    at CALLS_PER_GRAPH different offsets, so consecutive calls read different memory."""

    def __init__(self, num_tokens: int, num_kv_heads: int, head_dim: int):
        self.num_blocks = 1 + num_tokens // BLOCK_SIZE
        self.k = random_bf16((self.num_blocks, BLOCK_SIZE, num_kv_heads, head_dim))
        self.v = random_bf16((self.num_blocks, BLOCK_SIZE, num_kv_heads, head_dim))

    def tables(self, batch: int, context: int) -> list:
        """CALLS_PER_GRAPH block tables ``[batch, context / 16]``, each over its own region."""
        import cupy

        blocks = -(-context // BLOCK_SIZE)
        need = batch * blocks
        tables = []
        for call in range(CALLS_PER_GRAPH):
            offset = (call * max(need, (self.num_blocks - 1) // CALLS_PER_GRAPH)) % max(1, self.num_blocks - 1 - need)
            ids = 1 + offset + np.arange(need, dtype=np.int32)
            tables.append(cupy.asarray(ids.reshape(batch, blocks)))
        return tables


def time_kernels(pool: KVPool, lengths: np.ndarray, num_sms: int, bandwidth: float) -> dict:
    """Both kernels on one batch of context ``lengths`` (Qwen3-4B heads): time per call, GB/s,
    fraction of the copy bandwidth, and the split count each chose."""
    import cupy

    from openinfer.backend.cuda.decode_attention import legacy_splits, paged_decode_attention, split_count

    nh, nkv, d = QWEN3_4B["num_attention_heads"], QWEN3_4B["num_key_value_heads"], QWEN3_4B["head_dim"]
    batch = len(lengths)
    tables = pool.tables(batch, int(lengths.max()))
    lens = cupy.asarray(lengths.astype(np.int32))
    queries = [random_bf16((batch, nh, d)) for _ in tables]
    kv_bytes = 2 * int(lengths.sum()) * nkv * d * 2
    total_bytes = kv_bytes + 2 * 2 * batch * nh * d  # + q read + out written
    row = {"batch_size": batch, "kv_bytes": kv_bytes,
           "splits": {"split": legacy_splits(batch, nkv, num_sms), "mma": split_count(batch * nkv, num_sms)}}
    for name in KERNELS:
        calls = [lambda q=q, t=t, lens=lens, name=name: paged_decode_attention(
            q, pool.k, pool.v, t, lens, d**-0.5, num_sms, kernel_name=name)
            for q, t in zip(queries, tables, strict=True)]
        seconds = graph_seconds_per_call(calls)
        row[name] = {"us": seconds * 1e6, "gb_per_s": total_bytes / seconds / 1e9,
                     "copy_fraction": total_bytes / seconds / bandwidth}
    row["speedup"] = row["split"]["us"] / row["mma"]["us"]
    return row


def bench_attention(num_sms: int, bandwidth: float, batches, contexts) -> list[dict]:
    """Every batch x context with equal lengths, then ragged batches (lengths uniform in
    1 .. 2 x context, so the mean is the context) at the middle context."""
    nkv, d = QWEN3_4B["num_key_value_heads"], QWEN3_4B["head_dim"]
    pool = KVPool(max(batches) * max(contexts), nkv, d)
    rng = np.random.default_rng(0)
    cases = [(b, c, False) for c in contexts for b in batches]
    middle = sorted(contexts)[len(contexts) // 2]
    cases += [(b, middle, True) for b in batches if b >= 16]
    rows = []
    for batch, context, ragged in cases:
        lengths = rng.integers(1, 2 * context, batch) if ragged else np.full(batch, context)
        row = {"context": context, "ragged": ragged, **time_kernels(pool, lengths, num_sms, bandwidth)}
        rows.append(row)
        log(f"attention bs={batch:3d} ctx={context:4d}{' ragged' if ragged else ''}: split "
            f"{row['split']['us']:8.1f} us ({row['split']['copy_fraction']:4.0%}) | mma {row['mma']['us']:8.1f} us "
            f"({row['mma']['copy_fraction']:4.0%}, splits {row['splits']['mma']}) | x{row['speedup']:.2f}")
    return rows


def build_qwen3_4b(backend):
    """Qwen3-4B's decoder on openinfer's public layers, random bf16 weights made on the device."""
    from openinfer import (
        AttentionSpec,
        DecoderLayer,
        DecoderStack,
        RotaryEmbedding,
        rope_parameters_from_config,
    )
    from openinfer.backend.cuda.linear import CudaLinear

    c = QWEN3_4B
    h, d, nh, nkv, inter = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"], \
        c["intermediate_size"]
    rope = RotaryEmbedding.create(d, rope_parameters_from_config(c), 8192, c["max_position_embeddings"])

    def norm(n: int):
        return random_bf16((n,), 0.1)

    layers = []
    for _ in range(c["num_hidden_layers"]):
        spec = AttentionSpec(nh, nkv, d, rope, d**-0.5, norm(d), norm(d), c["rms_norm_eps"])
        layers.append(DecoderLayer(
            input_norm=norm(h), qkv=CudaLinear(random_bf16(((nh + 2 * nkv) * d, h), 0.02), None), attention=spec,
            o_proj=CudaLinear(random_bf16((h, nh * d), 0.02), None), post_attention_norm=norm(h),
            gate_up=CudaLinear(random_bf16((2 * inter, h), 0.02), None),
            down=CudaLinear(random_bf16((h, inter), 0.02), None)))
    embed = random_bf16((c["vocab_size"], h), 0.02)
    return DecoderStack(embed_tokens=embed, layers=layers, final_norm=norm(h), lm_head=CudaLinear(embed, None),
                        eps=c["rms_norm_eps"])


def bench_step(backend, bandwidth: float, batches, context: int) -> list[dict]:
    from openinfer.backend.cuda.attention import refresh_kernel_choices
    from openinfer.graph import CudaGraphRunner
    from openinfer.tools.ledger import gpu_seconds

    c = QWEN3_4B
    model = build_qwen3_4b(backend)
    blocks = -(-context // BLOCK_SIZE)
    kv = []
    for _ in range(c["num_hidden_layers"]):
        layer = backend.allocate_kv(1 + max(batches) * blocks, BLOCK_SIZE, c["num_key_value_heads"], c["head_dim"])
        layer.k[...] = random_bf16(layer.k.shape)
        layer.v[...] = random_bf16(layer.v.shape)
        kv.append(layer)
    log("built the Qwen3-4B-shaped model and its KV")
    runners = {}
    for name in KERNELS:  # the kernel is chosen when each graph is captured
        os.environ["OPENINFER_DECODE_ATTENTION"] = name
        refresh_kernel_choices()  # read once per process otherwise
        runners[name] = CudaGraphRunner(backend, lambda batch: model.forward(backend, batch, kv),
                                        max_num_seqs=max(batches), max_blocks_per_seq=blocks, buckets=batches)
        runners[name].capture()
    os.environ.pop("OPENINFER_DECODE_ATTENTION")
    refresh_kernel_choices()
    weight_bytes = sum(x.nbytes for layer in model.layers for x in (layer.qkv.weight, layer.o_proj.weight,
                                                                     layer.gate_up.weight, layer.down.weight))
    weight_bytes += model.embed_tokens.nbytes
    rows = []
    for batch in batches:
        host = decode_batch(batch, context, blocks)
        times: dict[str, list[float]] = {name: [] for name in KERNELS}
        for _ in range(3):  # interleaved, so drift hits both alike
            for name, runner in runners.items():
                runner.run(host)  # fills the static batch
                graph = runner.graphs[batch].graph
                times[name].append(gpu_seconds(graph.launch, 20, 2))
        kv_bytes = batch * context * c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * c["head_dim"] * 2
        roofline = (weight_bytes + kv_bytes) / bandwidth
        row = {"batch_size": batch, "context": context, "roofline_ms": roofline * 1e3}
        for name in KERNELS:
            step = float(np.median(times[name]))
            row[name] = {"step_ms": step * 1e3, "runs_ms": [t * 1e3 for t in times[name]],
                         "tokens_per_s": batch / step, "roofline_fraction": roofline / step}
        row["speedup"] = row["split"]["step_ms"] / row["mma"]["step_ms"]
        rows.append(row)
        log(f"step bs={batch} ctx={context}: split {row['split']['step_ms']:.2f} ms | mma "
            f"{row['mma']['step_ms']:.2f} ms (roofline {row['roofline_ms']:.2f} ms) | x{row['speedup']:.2f}")
    return rows


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["attention"] if not r.get("ragged")]
    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(1, len(contexts) + (1 if report.get("step") else 0),
                             figsize=(4.6 * (len(contexts) + 1), 4.2), squeeze=False)
    for ax, context in zip(axes[0], contexts, strict=False):
        sub = [r for r in rows if r["context"] == context]
        bs = [r["batch_size"] for r in sub]
        for name, style in (("split", "s--"), ("mma", "o-")):
            ax.plot(bs, [100 * r[name]["copy_fraction"] for r in sub], style, label=f"{name} kernel")
        ax.axhline(80, color="k", lw=0.8, ls=":", label="80 % goal")
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 105)
        ax.set_xlabel("batch size")
        ax.set_ylabel("% of copy bandwidth")
        ax.set_title(f"decode attention, context {context}")
        ax.legend(fontsize=8)
    if report.get("step"):
        ax = axes[0][-1]
        steps = report["step"]
        x = np.arange(len(steps))
        ax.bar(x - 0.2, [r["split"]["step_ms"] for r in steps], 0.4, label="split kernel")
        ax.bar(x + 0.2, [r["mma"]["step_ms"] for r in steps], 0.4, label="mma kernel")
        ax.scatter(x, [r["roofline_ms"] for r in steps], color="k", marker="_", s=400, label="HBM roofline")
        ax.set_xticks(x, [f"bs {r['batch_size']}, ctx {r['context']}" for r in steps])
        ax.set_ylabel("ms per decode step")
        ax.set_title("Qwen3-4B decode step (graph replay)")
        ax.legend(fontsize=8)
    fig.suptitle(f"{report['gpu']}: copy bandwidth {report['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="batch 1/64/256 at context 1k only")
    parser.add_argument("--no-step", action="store_true", help="skip the whole-model decode step")
    parser.add_argument("--plot", type=Path, help="only draw the PNG of this JSON report")
    args = parser.parse_args()
    if args.plot:
        plot(json.loads(args.plot.read_text()), args.plot.with_suffix(".png"))
        return

    import cupy

    from openinfer.backend.cuda import CudaBackend

    backend = CudaBackend()
    bandwidth = copy_bandwidth()
    log(f"{backend.device_name}: copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    batches, contexts = ((1, 64, 256), (1024,)) if args.quick else (BATCHES, CONTEXTS)
    report = {"gpu": backend.device_name, "num_sms": backend.num_sms, "cupy": cupy.__version__,
              "copy_bandwidth_bytes_per_s": bandwidth,
              "attention": bench_attention(backend.num_sms, bandwidth, batches, contexts)}
    cupy.get_default_memory_pool().free_all_blocks()
    if not args.no_step:
        report["step"] = bench_step(backend, bandwidth, STEP_BATCHES, STEP_CONTEXT)
    outs = [RESULTS] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else [])
    for out in outs:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_decode_attention.json").write_text(json.dumps(report, indent=2))
    try:
        for out in outs:
            plot(report, out / "gpu_decode_attention.png")
    except ImportError:
        log("matplotlib missing: JSON only (draw it later with --plot)")


if __name__ == "__main__":
    main()
