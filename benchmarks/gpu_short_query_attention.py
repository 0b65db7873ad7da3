"""GPU benchmark: the short-query attention kernel's two layouts side by side in one run
(openinfer.backend.cuda.decode_attention.short_query_attention_mma, tiles "warp" and "shared"):
the warm-prefix request's device step, a 16-token query over a long cached context.

  kernel  Qwen3-4B's attention (32 query heads, 8 KV heads, head_dim 128, paged bf16 KV, block 16)
          for batch 1 (and 4) x 16 new tokens over 1k / 4k / 16k / 32k of context: time per call
          (a CUDA graph of 8 calls over different KV regions, so the keys come from HBM, not L2),
          effective GB/s = KV bytes / time and its fraction of the copy bandwidth, the split count;
          the shared layout also at 16 and 32 splits;
  step    the whole Qwen3-4B forward of that request (random bf16 weights, 36 layers, one sequence
          of 16 new tokens, the engine's short-prefill CUDA graph of one sequence) at each context,
          one graph captured per layout, replays interleaved.
Writes benchmarks/results/gpu_short_query_attention.json and .png (copies under $OUT when set).
``--device cpu``: a dry run of the plan (shapes, byte counts, split counts) without CuPy.

    python benchmarks/gpu_short_query_attention.py [--contexts 1024 4096 16384] [--no-step]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from gpu_bench import BLOCK_SIZE, QWEN3_4B  # noqa: E402

RESULTS = Path(__file__).parent / "results"
NEW_TOKENS = 16
CALLS_PER_GRAPH = 8
LAYOUTS = ("warp", "shared")
TILE_SOFTMAX = "shared_tile_softmax"  # the shared layout with OPENINFER_SHORT_QUERY_SOFTMAX=tile (opt-in)
SM90 = "sm90"  # attention.short_query_attention_sm90: the Hopper wgmma kernel (OPENINFER_SM90_SHORT_QUERY=1)
STEP_VARIANTS = (*LAYOUTS, TILE_SOFTMAX, SM90)
# the sm90 kernel's timed settings: (name, splits (None: its default), K/V stages of 32 KB, K/V runs: a
# tile of consecutive blocks, as KVPool's tables are, in one TMA box per column block, splits per cluster)
SM90_VARIANTS = ((SM90, None, 3, True, 1), ("sm90_no_runs", None, 3, False, 1), ("sm90_splits32", 32, 3, True, 1),
                 ("sm90_splits8", 8, 3, True, 1), ("sm90_stages6", None, 6, True, 1),
                 ("sm90_splits32_cluster2", 32, 3, True, 2))


def sm90_default_splits(batch: int, stages: int, num_sms: int) -> int:
    """The split count short_query_attention_sm90 picks for ``batch`` sequences of NEW_TOKENS."""
    from openinfer.backend.cuda.decode_attention_plan import shared_split_count

    return shared_split_count(batch * QWEN3_4B["num_key_value_heads"] * 2, num_sms)


def set_sm90(on: bool) -> None:
    """Sets OPENINFER_SM90_SHORT_QUERY (the engine reads it when a graph is captured)."""
    from openinfer.backend.cuda.attention_routing import SM90_SHORT_QUERY_ENV, wanted_sm90_short_query

    os.environ[SM90_SHORT_QUERY_ENV] = "1" if on else "0"  # (on by default: the mma layouts need "0")
    wanted_sm90_short_query.cache_clear()


def set_tile_softmax(name: str | None) -> str:
    """Sets OPENINFER_SHORT_QUERY_SOFTMAX for variant ``name`` (None: unset); returns its layout
    (the sm90 variant runs the default layout where the Hopper kernel does not apply)."""
    from openinfer.backend.cuda import decode_attention_plan

    set_sm90(name == SM90)
    if name == TILE_SOFTMAX:
        os.environ[decode_attention_plan.SHORT_QUERY_SOFTMAX_ENV] = "tile"
    else:
        os.environ.pop(decode_attention_plan.SHORT_QUERY_SOFTMAX_ENV, None)
    decode_attention_plan.wanted_tile_softmax.cache_clear()
    return "shared" if name in (TILE_SOFTMAX, SM90) else (name or "shared")
H200_SMS = 132  # the dry run's split counts


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def kv_bytes(batch: int, context: int) -> int:
    return 2 * batch * context * QWEN3_4B["num_key_value_heads"] * QWEN3_4B["head_dim"] * 2


def planned_splits(layout: str, batch: int, num_sms: int) -> int:
    """The split count the launcher picks for ``batch`` sequences of NEW_TOKENS new tokens."""
    from openinfer.backend.cuda.decode_attention_plan import short_query_launch

    nh, nkv = QWEN3_4B["num_attention_heads"], QWEN3_4B["num_key_value_heads"]
    return short_query_launch(layout, batch, nkv, nh // nkv, QWEN3_4B["head_dim"], NEW_TOKENS, num_sms).splits


def bench_kernel(num_sms: int, bandwidth: float, batches, contexts) -> list[dict]:
    import cupy
    from gpu_decode_attention import KVPool, graph_seconds_per_call, random_bf16

    from openinfer.backend.cuda.attention import short_query_attention_sm90, sm90_short_query_supported
    from openinfer.backend.cuda.decode_attention import short_query_attention_mma
    from openinfer.backend.cuda.loader import kernel

    nh, nkv, d = QWEN3_4B["num_attention_heads"], QWEN3_4B["num_key_value_heads"], QWEN3_4B["head_dim"]
    pool = KVPool(CALLS_PER_GRAPH * max(batches) * max(contexts), nkv, d)
    sm90 = sm90_short_query_supported(d, nh // nkv, pool.k, pool.v)
    rows = []
    for context in contexts:
        for batch in batches:
            tables = pool.tables(batch, context)
            lens = cupy.full(batch, context, dtype=cupy.int32)
            query_start = cupy.arange(0, NEW_TOKENS * (batch + 1), NEW_TOKENS, dtype=cupy.int32)
            queries = [random_bf16((batch * NEW_TOKENS, nh, d)) for _ in tables]
            outs = [cupy.empty((batch * NEW_TOKENS, nh * d), cupy.uint16) for _ in tables]
            variants = [(layout, None) for layout in LAYOUTS] + [("shared", s) for s in (16, 32)] + [(TILE_SOFTMAX, None)]
            row = {"batch_size": batch, "context": context, "new_tokens": NEW_TOKENS,
                   "kv_bytes": kv_bytes(batch, context)}
            for name, splits in variants:
                layout = set_tile_softmax(name)
                def call(q, t, o, lens=lens, query_start=query_start, layout=layout, splits=splits):
                    return short_query_attention_mma(q, pool.k, pool.v, t, lens, query_start, NEW_TOKENS, d**-0.5,
                                                     num_sms, splits=splits, tiles=layout, out=o)
                calls = [functools.partial(call, q, t, o) for q, t, o in zip(queries, tables, outs, strict=True)]
                seconds = graph_seconds_per_call(calls)
                set_tile_softmax(None)
                name = name if splits is None else f"{layout}_splits{splits}"
                row[name] = {"us": seconds * 1e6, "gb_per_s": row["kv_bytes"] / seconds / 1e9,
                             "copy_fraction": row["kv_bytes"] / seconds / bandwidth,
                             "splits": splits or planned_splits(layout, batch, num_sms)}
            for name, splits, stages, runs, cluster in SM90_VARIANTS if sm90 else ():
                def call90(q, t, o, lens=lens, query_start=query_start, splits=splits, stages=stages, runs=runs,
                           cluster=cluster):
                    return short_query_attention_sm90(q, pool.k, pool.v, t, lens, query_start, NEW_TOKENS, d**-0.5,
                                                      num_sms, splits=splits, stages=stages, kv_runs=runs,
                                                      cluster=cluster, out=o)
                calls = [functools.partial(call90, q, t, o) for q, t, o in zip(queries, tables, outs, strict=True)]
                seconds = graph_seconds_per_call(calls)
                row[name] = {"us": seconds * 1e6, "gb_per_s": row["kv_bytes"] / seconds / 1e9,
                             "copy_fraction": row["kv_bytes"] / seconds / bandwidth, "stages": stages, "kv_runs": runs,
                             "cluster": cluster,
                             "splits": splits or sm90_default_splits(batch, stages, num_sms)}
            if sm90:  # the split merge alone (decode_attention_merge over the default split count's partials)
                splits = row[SM90]["splits"]
                rows_out = batch * NEW_TOKENS
                partial_out = cupy.zeros((rows_out, nh, splits, d), cupy.float32)
                partial_ml = cupy.zeros((rows_out, nh, splits, 2), cupy.float32)
                merge = kernel("decode_attention_mma.cu", "decode_attention_merge", HEAD_DIM=d, GROUP=nh // nkv)
                calls = [functools.partial(merge, (nh, rows_out), (128,),
                                           (partial_out, partial_ml, o, np.int32(nh), np.int32(splits))) for o in outs]
                row["sm90_merge_only"] = {"us": graph_seconds_per_call(calls) * 1e6, "splits": splits}
            # the same result both ways (last call's output of each layout)
            ref = short_query_attention_mma(queries[0], pool.k, pool.v, tables[0], lens, query_start, NEW_TOKENS,
                                            d**-0.5, num_sms, tiles="warp")
            new = short_query_attention_mma(queries[0], pool.k, pool.v, tables[0], lens, query_start, NEW_TOKENS,
                                            d**-0.5, num_sms, tiles="shared")
            as_float = lambda x: (x.astype(cupy.uint32) << 16).view(cupy.float32)  # noqa: E731
            row["max_abs_difference"] = float(cupy.abs(as_float(new) - as_float(ref)).max())
            row["speedup"] = row["warp"]["us"] / row["shared"]["us"]
            row["tile_softmax_speedup"] = row["shared"]["us"] / row[TILE_SOFTMAX]["us"]
            row["per_step_saving_ms_36_layers"] = 36 * (row["warp"]["us"] - row["shared"]["us"]) / 1e3
            if sm90:
                ours = short_query_attention_sm90(queries[0], pool.k, pool.v, tables[0], lens, query_start, NEW_TOKENS,
                                                  d**-0.5, num_sms)
                row["sm90_max_abs_difference"] = float(cupy.abs(as_float(ours) - as_float(ref)).max())
                row["sm90_vs_tile_softmax"] = row[TILE_SOFTMAX]["us"] / row[SM90]["us"]
                others = ", ".join(f"{name[len(SM90) + 1:]} {row[name]['us']:.1f}" for name, *_ in SM90_VARIANTS[1:])
                log(f"  sm90 bs={batch} ctx={context:5d}: {row[SM90]['us']:7.1f} us ({row[SM90]['copy_fraction']:4.0%}, "
                    f"{row[SM90]['splits']} splits; {others}; merge alone {row['sm90_merge_only']['us']:.1f}) "
                    f"x{row['sm90_vs_tile_softmax']:.2f} vs tile softmax, max |diff| vs warp "
                    f"{row['sm90_max_abs_difference']:.2e}")
            rows.append(row)
            log(f"kernel bs={batch} ctx={context:5d}: warp {row['warp']['us']:7.1f} us "
                f"({row['warp']['copy_fraction']:4.0%}, {row['warp']['splits']} splits) | shared "
                f"{row['shared']['us']:7.1f} us ({row['shared']['copy_fraction']:4.0%}, {row['shared']['splits']} "
                f"splits; 16: {row['shared_splits16']['us']:.1f}, 32: {row['shared_splits32']['us']:.1f}) "
                f"x{row['speedup']:.2f}, max |diff| {row['max_abs_difference']:.2e}; tile softmax "
                f"{row[TILE_SOFTMAX]['us']:.1f} us (x{row['tile_softmax_speedup']:.2f} vs shared)")
    return rows


def bench_step(backend, contexts) -> list[dict]:
    """The Qwen3-4B forward of one sequence's 16 new tokens over ``context - 16`` cached ones, in
    the engine's short-prefill graph of one sequence, one graph per layout."""
    from gpu_decode_attention import build_qwen3_4b, random_bf16

    from openinfer.backend.base import ForwardBatch
    from openinfer.backend.cuda import decode_attention_plan
    from openinfer.graph import CudaGraphRunner
    from openinfer.tools.ledger import gpu_seconds

    c = QWEN3_4B
    model = build_qwen3_4b(backend)
    max_blocks = -(-max(contexts) // BLOCK_SIZE) + 1
    kv = []
    for _ in range(c["num_hidden_layers"]):
        layer = backend.allocate_kv(1 + max_blocks, BLOCK_SIZE, c["num_key_value_heads"], c["head_dim"])
        layer.k[...] = random_bf16(layer.k.shape)
        layer.v[...] = random_bf16(layer.v.shape)
        kv.append(layer)
    log("built the Qwen3-4B-shaped model and its KV")
    runners = {}
    for name in STEP_VARIANTS:  # the kernel is chosen when each graph is captured
        layout = set_tile_softmax(name)
        os.environ[decode_attention_plan.SHORT_QUERY_TILES_ENV] = layout
        decode_attention_plan.wanted_short_query_tiles.cache_clear()
        runners[name] = CudaGraphRunner(backend, lambda batch: model.forward(backend, batch, kv), max_num_seqs=1,
                                        max_blocks_per_seq=max_blocks, buckets=(1,), prefill_buckets=(1,))
        runners[name].capture()
    set_tile_softmax(None)
    os.environ.pop(decode_attention_plan.SHORT_QUERY_TILES_ENV)
    decode_attention_plan.wanted_short_query_tiles.cache_clear()
    rows = []
    for context in contexts:
        tables = np.zeros((1, max_blocks), np.int32)
        tables[0, :-(-context // BLOCK_SIZE)] = 1 + np.arange(-(-context // BLOCK_SIZE))
        token_ids = np.random.default_rng(context).integers(0, c["vocab_size"], NEW_TOKENS).astype(np.int32)
        host = ForwardBatch.over_blocks(tables, [context - NEW_TOKENS], [NEW_TOKENS], BLOCK_SIZE, token_ids)
        times: dict[str, list[float]] = {name: [] for name in STEP_VARIANTS}
        for _ in range(3):  # interleaved, so drift hits both alike
            for layout, runner in runners.items():
                assert runner.prefill_bucket_for(host) == 1, "the step does not replay in the short-prefill graph"
                runner.run(host)  # fills the static batch
                graph = runner.prefill_graphs[1].graph
                times[layout].append(gpu_seconds(graph.launch, 20, 2))
        row = {"context": context, "new_tokens": NEW_TOKENS}
        for name in STEP_VARIANTS:
            row[name] = {"step_ms": float(np.median(times[name])) * 1e3, "runs_ms": [t * 1e3 for t in times[name]]}
        row["speedup"] = row["warp"]["step_ms"] / row["shared"]["step_ms"]
        row["sm90_vs_tile_softmax"] = row[TILE_SOFTMAX]["step_ms"] / row[SM90]["step_ms"]
        rows.append(row)
        log(f"step ctx={context:5d}: warp {row['warp']['step_ms']:.3f} ms | shared {row['shared']['step_ms']:.3f} ms"
            f" | x{row['speedup']:.2f} | tile softmax {row[TILE_SOFTMAX]['step_ms']:.3f} ms | sm90 "
            f"{row[SM90]['step_ms']:.3f} ms (x{row['sm90_vs_tile_softmax']:.2f})")
    return rows


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if report.get("step") else 1
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.2), squeeze=False)
    rows = [r for r in report["kernel"] if r["batch_size"] == 1]
    x = np.arange(len(rows))
    ax = axes[0][0]
    layouts = [name for name in ("warp", "shared", TILE_SOFTMAX, SM90) if name in rows[0]]
    width = 0.8 / len(layouts)
    for i, layout in enumerate(layouts):
        ax.bar(x + (i - (len(layouts) - 1) / 2) * width, [r[layout]["us"] for r in rows], width,
               label=f"{layout} ({rows[0][layout]['splits']} splits)")
    ax.set_xticks(x, [f"{r['context'] // 1024}k" for r in rows])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("us per layer")
    ax.set_title("short-query attention, bs 1 x 16 new tokens")
    ax.legend(fontsize=8)
    if report.get("step"):
        ax = axes[0][1]
        steps = report["step"]
        x = np.arange(len(steps))
        layouts = [name for name in STEP_VARIANTS if name in steps[0]]
        width = 0.8 / len(layouts)
        for i, layout in enumerate(layouts):
            ax.bar(x + (i - (len(layouts) - 1) / 2) * width, [r[layout]["step_ms"] for r in steps], width,
                   label=layout)
        ax.set_xticks(x, [f"{r['context'] // 1024}k" for r in steps])
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("ms per step (graph replay)")
        ax.set_title("Qwen3-4B step of a 16-token warm tail")
        ax.legend(fontsize=8)
    fig.suptitle(f"{report['gpu']}: copy bandwidth {report['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def dry_run(batches, contexts) -> dict:
    """The plan without a GPU: per shape, the KV bytes and each layout's grid and splits."""
    from openinfer.backend.cuda.decode_attention_plan import short_query_launch

    nh, nkv, d = QWEN3_4B["num_attention_heads"], QWEN3_4B["num_key_value_heads"], QWEN3_4B["head_dim"]
    rows = []
    for context in contexts:
        for batch in batches:
            row = {"batch_size": batch, "context": context, "kv_bytes": kv_bytes(batch, context)}
            for layout in LAYOUTS:
                launch = short_query_launch(layout, batch, nkv, nh // nkv, d, NEW_TOKENS, H200_SMS)
                row[layout] = {"kernel": launch.kernel, "grid": list(launch.grid(batch, nkv)),
                               "splits": launch.splits, "shared_bytes": launch.shared_bytes,
                               "kv_reads": launch.row_blocks}
            rows.append(row)
            print(json.dumps(row))
    return {"device": "cpu (dry run)", "kernel": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--step-contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--no-step", action="store_true", help="skip the whole-model step")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run of the plan")
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_short_query_attention.json")
    args = parser.parse_args()
    if any(c < NEW_TOKENS for c in args.contexts + args.step_contexts) or any(b < 1 for b in args.batches):
        parser.error(f"contexts must be >= {NEW_TOKENS} tokens and batches >= 1")
    if args.device == "cpu":
        dry_run(args.batches, args.contexts)
        return

    import cupy
    from gpu_decode_attention import copy_bandwidth

    from openinfer.backend.cuda import CudaBackend

    backend = CudaBackend()
    props = cupy.cuda.runtime.getDeviceProperties(0)
    bandwidth = copy_bandwidth()
    report = {"gpu": props["name"].decode(), "num_sms": backend.num_sms, "copy_bandwidth_bytes_per_s": bandwidth,
              "note": "kernel: per call, graph of 8 calls over different KV regions; step: graph replay medians"}
    log(f"{report['gpu']}: {backend.num_sms} SMs, copy {bandwidth / 1e12:.2f} TB/s")
    report["kernel"] = bench_kernel(backend.num_sms, bandwidth, args.batches, args.contexts)
    write_report(report, args.out)  # the kernel rows stand even if the step runs out of time
    if not args.no_step:
        report["step"] = bench_step(backend, args.step_contexts)
        write_report(report, args.out)


def write_report(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))
    if os.environ.get("OUT"):
        for suffix in (".json", ".png"):
            shutil.copy(out.with_suffix(suffix), Path(os.environ["OUT"]) / out.with_suffix(suffix).name)
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
