"""GPU: where a captured decode step's time goes, kernel by kernel — each kernel's device time and the gap
before it, read from a CUDA-graph replay (not the ledger's eager op-by-op replay), and the step time of
switch sets A/B'd in one process (the same weights, the same machine).

    python benchmarks/gpu_step_timeline.py --random moonlight --batches 1,16,64 --context 1024 \\
        --variant base= --variant expand_small=OPENINFER_MLA_EXPAND_SMALL=1 --out timeline.json

For each variant (``name=ENV=VALUE,ENV=VALUE``; ``base=`` sets nothing) the switches are set, every asked
bucket's decode graph is captured again (after one eager warm-up forward, so new kernels compile outside the
capture), and the replay is timed by events (median of ``--repeats``). The first variant's replays are also
traced with torch's profiler (CUPTI kernel records, which carry each kernel of a graph replay with its own
start and end): per kernel name the count, device time and the gaps before it; the replay's span against the
sum of its kernels (what overlap or fewer gaps could win); one middle layer's kernel sequence. torch is a
benchmark dependency only (the engine never imports it); without it the trace is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

SEGMENT_END = ("moe_combine", "moe_combine_vec8", "moe_combine_add_rms_norm")  # a MoE layer's last kernel


_READ_KERNELS = r"""
// Read-only HBM streams (results XOR-folded so nothing is dropped). read_linear: the whole grid walks the buffer
// in consecutive 16-byte pieces, 8 loads in flight per thread. read_rows: the expert GEMM's pattern, a block per
// tile of 128 rows x 4096 bytes (a [N, 2048] bf16 weight's 128-row block), ``run`` contiguous bytes of every row
// per stage, stages in k order.
extern "C" __global__ void read_linear(const uint4* __restrict__ p, long long n, unsigned* out) {
    unsigned acc = 0;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    for (; i + 7 * stride < n; i += 8 * stride) {
        uint4 v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = __ldcs(p + i + j * stride);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    }
    for (; i < n; i += stride) { const uint4 v = __ldcs(p + i); acc ^= v.x ^ v.y ^ v.z ^ v.w; }
    if (acc == 0x9e3779b9u) out[0] = acc;
}
extern "C" __global__ void read_rows(const uint4* __restrict__ p, long long tiles, int run, unsigned* out) {
    unsigned acc = 0;
    const int per_row = run / 16, rows_per_pass = blockDim.x / per_row;  // 16-byte pieces of a row's run
    const int r0 = threadIdx.x / per_row, piece = threadIdx.x % per_row;
    for (long long t = blockIdx.x; t < tiles; t += gridDim.x) {
        const uint4* tile = p + t * 128 * 256;  // 128 rows of 4096 bytes
        for (int k = 0; k < 4096 / run; ++k) {
            for (int rb = 0; rb < 128; rb += 8 * rows_per_pass) {
                uint4 v[8];
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const int r = rb + r0 + j * rows_per_pass;
                    v[j] = r < 128 ? __ldcs(tile + r * 256 + k * per_row + piece) : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
                for (int j = 0; j < 8; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
            }
        }
    }
    if (acc == 0x9e3779b9u) out[0] = acc;
}
"""


def read_ceilings(gigabytes: float = 2.0, repeats: int = 10) -> dict[str, float]:
    """Read-only HBM bandwidth (bytes read per second) of a few access patterns, and cupy's copy rate (read +
    written): what a weight-streaming GEMM could reach, and whether its row-strided pattern costs any."""
    import cupy

    from openinfer.tools.ledger import gpu_seconds

    module = cupy.RawModule(code=_READ_KERNELS)
    pieces = int(gigabytes * 2**30) // 16 // (128 * 256) * (128 * 256)
    buffer = cupy.ones(pieces * 4, dtype=cupy.uint32)
    sink = cupy.zeros(1, dtype=cupy.uint32)
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    nbytes = pieces * 16
    found: dict[str, float] = {}
    linear = module.get_function("read_linear")
    for blocks_per_sm, threads in ((4, 512), (8, 256), (16, 256)):
        seconds = gpu_seconds(lambda b=blocks_per_sm, t=threads: linear((sms * b,), (t,), (buffer, cupy.int64(pieces),
                                                                                            sink)), repeats)
        found[f"linear_{blocks_per_sm}x{threads}"] = nbytes / seconds
    rows = module.get_function("read_rows")
    tiles = pieces // (128 * 256)
    for run in (128, 256, 512):
        for blocks_per_sm in (1, 2, 4):
            seconds = gpu_seconds(lambda r=run, b=blocks_per_sm: rows((sms * b,), (256,), (
                buffer, cupy.int64(tiles), cupy.int32(r), sink)), repeats)
            found[f"rows{run}_{blocks_per_sm}x256"] = nbytes / seconds
    half = buffer[: buffer.size // 2]
    copy_to = cupy.empty_like(half)
    found["copy_read_plus_written"] = 2 * half.nbytes / gpu_seconds(lambda: copy_to.__setitem__(Ellipsis, half), repeats)
    return found


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """``name=ENV=VALUE,ENV=VALUE`` (or ``name=``) -> (name, {ENV: VALUE})."""
    name, _, rest = text.partition("=")
    if not name:
        raise argparse.ArgumentTypeError(f"a variant is name=ENV=VALUE,...; got {text!r}")
    env = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("OPENINFER_"):
            raise argparse.ArgumentTypeError(f"variant {name!r}: expected OPENINFER_*=VALUE, got {item!r}")
        env[key] = value
    return name, env


def recapture(engine: Any, bucket: int, host: Any) -> Any:
    """Capture ``bucket``'s decode graph again under the current switches (warm-up forward first), filled
    with ``host``'s step; returns the captured graph."""
    import cupy

    runner = engine.runner
    static = runner.graphs[bucket].static
    static.fill(host)
    with cupy.cuda.using_allocator(runner.pool.malloc), runner.stream:
        captured = runner._capture_warmed(cupy, static, warmed=True, what=f"bucket {bucket}")
        runner.stream.synchronize()
    runner.graphs[bucket] = captured
    captured.static.fill(host)
    cupy.cuda.get_current_stream().synchronize()
    return captured


def replay_seconds(captured: Any, repeats: int) -> list[float]:
    import cupy

    for _ in range(3):
        captured.graph.launch()
    cupy.cuda.get_current_stream().synchronize()
    times = []
    for _ in range(repeats):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        captured.graph.launch()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return times


def trace_kernels(captured: Any, replays: int) -> list[list[dict[str, Any]]] | str:
    """The kernels of ``replays`` graph replays as [{name, start_us, dur_us}] per replay (CUPTI through
    torch.profiler), or a string saying why not."""
    import cupy

    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except Exception as exc:  # a benchmark dependency only
        return f"torch.profiler unavailable: {exc!r}"
    cupy.cuda.get_current_stream().synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                captured.graph.launch()
                cupy.cuda.get_current_stream().synchronize()  # replays apart: a clear boundary
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            trace = json.loads(Path(path).read_text())
    except Exception as exc:
        return f"profiling failed: {exc!r}"
    del torch
    kernels = sorted(({"name": e["name"], "start_us": float(e["ts"]), "dur_us": float(e.get("dur", 0.0))}
                      for e in trace.get("traceEvents", []) if e.get("cat") == "kernel"), key=lambda k: k["start_us"])
    if not kernels:
        return "the trace holds no kernel records"
    # replays apart: split at the largest gaps (each replay was synchronised before the next launch)
    gaps = sorted(range(1, len(kernels)), key=lambda i: kernels[i]["start_us"] - kernels[i - 1]["start_us"]
                  - kernels[i - 1]["dur_us"], reverse=True)[:replays - 1]
    cuts = [0, *sorted(gaps), len(kernels)]
    return [kernels[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]


def short_name(name: str) -> str:
    return name if len(name) <= 64 else name[:61] + "..."


def summarise(replay: list[dict[str, Any]]) -> dict[str, Any]:
    """One replay's kernels: span, summed device time, summed gaps (negative: overlap), per kernel name."""
    first, last_end = replay[0]["start_us"], max(k["start_us"] + k["dur_us"] for k in replay)
    by_name: dict[str, dict[str, float]] = {}
    sequence = []
    previous_end = first
    for k in replay:
        gap = k["start_us"] - previous_end
        previous_end = max(previous_end, k["start_us"] + k["dur_us"])
        row = by_name.setdefault(short_name(k["name"]), {"count": 0, "dur_us": 0.0, "gap_before_us": 0.0})
        row["count"] += 1
        row["dur_us"] += k["dur_us"]
        row["gap_before_us"] += gap
        sequence.append({"name": short_name(k["name"]), "dur_us": round(k["dur_us"], 2), "gap_before_us": round(gap, 2)})
    # one middle MoE layer: the kernels after the (n/2 - 1)-th layer end up to the (n/2)-th
    ends = [i for i, k in enumerate(replay) if k["name"] in SEGMENT_END]
    layer = []
    if len(ends) >= 3:
        mid = len(ends) // 2
        layer = sequence[ends[mid - 1] + 1: ends[mid] + 1]
    busy = sum(k["dur_us"] for k in replay)
    return {"kernels": len(replay), "span_us": last_end - first, "kernel_sum_us": busy,
            "gap_sum_us": sum(max(0.0, s["gap_before_us"]) for s in sequence),
            "overlap_sum_us": -sum(min(0.0, s["gap_before_us"]) for s in sequence),
            "by_name": dict(sorted(by_name.items(), key=lambda kv: -kv[1]["dur_us"])), "middle_layer": layer,
            "sequence": sequence}


def as_float(values: np.ndarray) -> np.ndarray:
    """Logits as float32: bf16 bits (uint16) widened, other dtypes cast."""
    if values.dtype == np.uint16:
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--random", default="moonlight", help="a ledger preset (openinfer.tools.ledger PRESETS)")
    parser.add_argument("--checkpoint-dir", default="/tmp/openinfer-timeline")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--variant", type=parse_variant, action="append", default=[],
                        help="name=ENV=VALUE,... (repeatable; default: base= only)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2, help="passes over the variants (A/B/A/B...)")
    parser.add_argument("--trace-replays", type=int, default=3)
    parser.add_argument("--trace-variants", default="",
                        help="comma-separated variants whose first round is traced too (the first variant always is)")
    parser.add_argument("--read-ceilings", action="store_true",
                        help="first measure read-only HBM bandwidth by access pattern (read_ceilings)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b]
    variants = args.variant or [("base", {})]

    # a timeout's SIGTERM still writes what was measured (the finally below)
    signal.signal(signal.SIGTERM, _interrupt)
    import cupy

    from openinfer import create_engine
    from openinfer.tools.ledger import BLOCK_SIZE, StepLayout, decode_batch, write_preset_config

    if args.read_ceilings:
        ceilings = read_ceilings()
        cupy.get_default_memory_pool().free_all_blocks()  # the 2 GB buffer, before the engine sizes its KV pool
        for name, rate in ceilings.items():
            print(f"read ceiling {name:24s} {rate / 1e12:.3f} TB/s", flush=True)
    path = write_preset_config(args.random, Path(args.checkpoint_dir) / args.random)
    blocks = max(batches) * -(-args.context // BLOCK_SIZE) + 2
    t0 = time.perf_counter()
    engine = create_engine(str(path), device="cuda", max_num_seqs=max(batches), max_model_len=args.context + BLOCK_SIZE,
                           num_kv_blocks=blocks, enable_prefix_cache=False, load_format="dummy")
    print(f"engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
    report: dict[str, Any] = {"preset": args.random, "context": args.context, "batches": batches,
                              "device": getattr(engine.model.backend, "device_name", "?"),
                              "variants": {name: env for name, env in variants}, "steps": {}, "traces": {},
                              "read_ceilings_bytes_per_s": ceilings if args.read_ceilings else None}
    layout = StepLayout.of(engine)
    hosts = {b: decode_batch(b, args.context, layout) for b in batches}
    saved = {key: os.environ.get(key) for _, env in variants for key in env}
    first_logits: dict[int, np.ndarray] = {}  # batch -> the first measured variant's logits
    try:
        for round_index in range(args.rounds):
            for name, env in variants:
                for key in saved:
                    os.environ.pop(key, None)
                os.environ.update(env)
                for b in batches:
                    bucket = engine.runner.bucket_for(hosts[b])
                    if bucket is None:
                        print(f"batch {b}: no decode graph bucket", flush=True)
                        continue
                    try:
                        captured = recapture(engine, bucket, hosts[b])
                        times = replay_seconds(captured, args.repeats)
                    except Exception as exc:  # a variant that fails is reported, the rest still runs
                        report["steps"].setdefault(name, {}).setdefault(str(b), []).append({"error": repr(exc)})
                        print(f"{name} b{b}: FAILED {exc!r}", flush=True)
                        cupy.cuda.runtime.deviceSynchronize()
                        continue
                    median = statistics.median(times)
                    # the step's logits (the replays' inputs are the same each time): equal bits across the
                    # variants say a switch changed the speed only
                    logits = cupy.asnumpy(captured.logits[:b])
                    first = first_logits.setdefault(b, logits)
                    same = bool(np.array_equal(logits, first))
                    diff = 0.0 if same else float(np.abs(as_float(logits) - as_float(first)).max())
                    report["steps"].setdefault(name, {}).setdefault(str(b), []).append(
                        {"median_s": median, "min_s": min(times), "round": round_index,
                         "logits_equal_to_first": same, "logits_max_abs_diff": diff})
                    Path(args.out).write_text(json.dumps(report, indent=1))
                    print(f"round {round_index} {name:14s} b{b}: step {median * 1e3:.3f} ms (min {min(times) * 1e3:.3f}); "
                          f"logits {'equal' if same else f'max |diff| {diff:.4g}'}",
                          flush=True)
                    traced = {variants[0][0], *filter(None, args.trace_variants.split(","))}
                    if round_index == 0 and name in traced and args.trace_replays:
                        replays = trace_kernels(captured, args.trace_replays)
                        key = str(b) if name == variants[0][0] else f"{name}:{b}"
                        if isinstance(replays, str):
                            report["traces"][key] = {"error": replays}
                            print(f"b{b} trace: {replays}", flush=True)
                        else:
                            summaries = [summarise(r) for r in replays]
                            best = min(summaries, key=lambda s: s["span_us"])
                            best["spans_us"] = [s["span_us"] for s in summaries]
                            report["traces"][key] = best
                            print(f"{key if key != str(b) else f'b{b}'} trace: {best['kernels']} kernels, span {best['span_us']:.1f} us, kernels "
                                  f"{best['kernel_sum_us']:.1f} us, gaps {best['gap_sum_us']:.1f} us, overlap "
                                  f"{best['overlap_sum_us']:.1f} us", flush=True)
                            for kname, row in list(best["by_name"].items())[:14]:
                                print(f"   {kname:64s} x{row['count']:4d} {row['dur_us']:8.1f} us  gaps "
                                      f"{row['gap_before_us']:7.1f} us", flush=True)
                            Path(args.out).write_text(json.dumps(report, indent=1))
    except KeyboardInterrupt as exc:
        print(f"stopped: {exc}", flush=True)
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value
        Path(args.out).write_text(json.dumps(report, indent=1))
        engine.close_sync()
    base = variants[0][0]
    for name, _ in variants:
        cells = []
        for b in batches:
            rows = [r["median_s"] for r in report["steps"].get(name, {}).get(str(b), []) if "median_s" in r]
            ref = [r["median_s"] for r in report["steps"].get(base, {}).get(str(b), []) if "median_s" in r]
            if rows:
                ratio = f" ({statistics.median(ref) / statistics.median(rows):.3f}x)" if ref else ""
                cells.append(f"b{b} {statistics.median(rows) * 1e3:.3f} ms{ratio}")
        print(f"summary {name:14s} " + ", ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
