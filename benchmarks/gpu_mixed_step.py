"""GPU: where the mixed steps of a 256-stream burst spend their device time, op by op against
their roofline, next to a plain decode step at the burst's batch; what the decodes riding in a
mixed step cost (each mixed step against the one with no decodes, op by op); and whether the
mixed step's decode attention (memory bound) overlaps the chunks' prefill attention (compute
bound) on two streams (OPENINFER_MIXED_OVERLAP).

A 256 x 1k-in / 128-out burst (benchmarks/gpu_concurrency.py) runs ~33 mixed steps of 8192 tokens
(the token budget: 0 to ~250 decodes first, then prompt pieces), then ~126 decode steps at batch
~225. The ledger (``openinfer.tools.ledger``) times each op of one such step in step order (every
call behind a spin kernel, an event between ops: no launch gaps), with bytes, FLOPs and % of
roofline; the measured step is the eager forward (mixed) or the CUDA graph replay (decode).

    python benchmarks/gpu_mixed_step.py [--decodes 0,8,126,200 --budget 8192 --prompt-len 1024]
        [--context 1088] [--decode-batch 192,224 --decode-context 1088] [--results-dir DIR] [--tag NAME]
    python benchmarks/gpu_mixed_step.py --device cpu --model-path DIR --decodes 0,3 --budget 40 \
        --prompt-len 16 --context 32 --decode-batch 4 --decode-context 32     # checks the script

``--random`` (default qwen3-4b): that ledger preset's shape with random weights. Writes
``mixed_step[_TAG].json`` + ``.md`` into ``--results-dir`` (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from openinfer.tools.ledger import (
    PRESETS,
    HostTimer,
    Ledger,
    Timer,
    breakdown,
    ceilings,
    gpu_seconds,
    op_kind,
    write_preset_config,
)
from openinfer.tools.ledger.batches import BLOCK_SIZE, step_batch

RESULTS = Path(__file__).parent / "results"
GEMM_KIND = "projections (GEMM)"


def _counts(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated counts, got {text!r}") from exc
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected counts >= 0, got {text!r}")
    return values


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def burst_step(decodes: int, budget: int, prompt_len: int, context: int) -> tuple[list[int], list[int]]:
    """New tokens and contexts per sequence of one mixed step of the burst, as the token budget
    cuts it: the ``decodes`` first (the scheduler's order, and the one the mixed attention split
    takes; each at ``context``), then, with decodes running, the rest of the prompt the previous
    step cut (``min(decodes, prompt_len - 1)`` tokens over its cached start), whole fresh prompts,
    and the first chunk of one more, to ``budget`` tokens."""
    if not 0 <= decodes < budget:
        raise ValueError(f"decodes must be in [0, {budget}), got {decodes}")
    new, contexts = [1] * decodes, [context] * decodes
    left = budget - decodes
    rest = min(decodes, prompt_len - 1, left)
    if rest:
        new.append(rest)
        contexts.append(prompt_len)
        left -= rest
    while left:
        piece = min(prompt_len, left)
        new.append(piece)
        contexts.append(piece)
        left -= piece
    return new, contexts


def compare(base: dict[str, Any], entry: dict[str, Any]) -> list[dict[str, Any]]:
    """Per op, the device time of ``entry`` against ``base`` (ms), largest difference first."""
    base_ms = {row["op"]: row["time_s"] * 1e3 for row in base["ops"] if not row["op"].startswith("(host")}
    entry_ms = {row["op"]: row["time_s"] * 1e3 for row in entry["ops"] if not row["op"].startswith("(host")}
    rows = [{"op": op, "base_ms": base_ms.get(op, 0.0), "ms": entry_ms.get(op, 0.0),
             "difference_ms": entry_ms.get(op, 0.0) - base_ms.get(op, 0.0)} for op in {*base_ms, *entry_ms}]
    return sorted(rows, key=lambda r: -abs(r["difference_ms"]))


def overlap_probe(call: Any, repeats: int) -> dict[str, float]:
    """Times one layer's mixed attention (``mixed_attention``'s recorded call): on one stream
    (OPENINFER_MIXED_OVERLAP=0), its prefill and decode parts alone, and the decode part on a
    second stream beside the prefill part (``mixed_attention``'s ``decode_stream``, the default)."""
    import cupy

    from openinfer.backend.cuda.attention import mixed_attention, prefill_attention
    from openinfer.backend.cuda.decode_attention import paged_decode_attention

    q, spec, kv, batch, split, num_sms = call.args
    rows = split.decode_rows
    out = cupy.empty((batch.num_tokens, spec.num_heads * spec.head_dim), dtype=cupy.uint16)
    side = cupy.cuda.Stream(non_blocking=True)

    def prefill_part() -> None:
        for tile_range in split.prefill_tile_ranges:
            prefill_attention(q, spec, kv, batch, out=out, tile_range=tile_range)

    def decode_part() -> None:
        paged_decode_attention(q[:rows], kv.k, kv.v, batch.block_tables[:rows], batch.context_lens[:rows],
                               spec.scale, num_sms, out=out[:rows])

    one_stream = {name: value for name, value in call.kwargs.items() if name != "decode_stream"}
    timed = {"one_stream_us": lambda: mixed_attention(*call.args, **one_stream), "prefill_part_us": prefill_part,
             "decode_part_us": decode_part,
             "two_streams_us": lambda: mixed_attention(q, spec, kv, batch, split, num_sms, decode_stream=side)}
    result = {name: gpu_seconds(fn, repeats, warmup=2) * 1e6 for name, fn in timed.items()}
    result["decode_rows"] = rows
    result["serial_sum_us"] = result["prefill_part_us"] + result["decode_part_us"]
    return result


def held_forward(engine: Any, timer: Any, host: Any, repeats: int) -> dict[str, float]:
    """The step's device time in one piece, with the host out of the picture: a spin kernel holds
    the device while the host enqueues the whole forward, events around the forward only. Set
    against the ops' sum (the same kernels replayed op by op) it says whether the measured step's
    excess is on the device (kernels the ledger does not list, or slower back to back) or on the
    host (preparing the batch, launching: the engine overlaps that with the previous step).
    ``forward_ms``: the model's forward on a prepared batch; ``prepare_and_forward_ms``: the
    batch's preparation (uploads, plans) inside the held window too."""
    import cupy

    backend, model = engine.model.backend, engine.model
    device = backend.prepare_batch(host)
    runs = {"forward_ms": lambda: model.forward(device, engine.kv_cache),
            "prepare_and_forward_ms": lambda: model.forward(backend.prepare_batch(host), engine.kv_cache)}
    out = {}
    for name, fn in runs.items():
        fn()
        cupy.cuda.get_current_stream().synchronize()
        began = time.perf_counter()
        fn()
        enqueue_s = time.perf_counter() - began
        cupy.cuda.get_current_stream().synchronize()
        times = []
        for _ in range(repeats):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            timer.hold(2.0 * enqueue_s + 0.01)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end))
        out[name] = float(sorted(times)[len(times) // 2])
        out[name.replace("_ms", "_enqueue_ms")] = 1e3 * enqueue_s
    return out


NORM_ROW_VARIANTS = {"default": {}, "late_weight": {"RMS_NORM_ROWS_LATE_WEIGHT": 1}}


def norm_rows_variants(rows_list: list[int], features: int, repeats: int) -> list[dict[str, Any]]:
    """``rms_norm.cu``'s ``rms_norm_rows`` per variant (``NORM_ROW_VARIANTS``: the kernel's compile-time
    switches) at each row count: device time, bandwidth (row read + written) against
    ``add_rms_norm_rows`` on the same rows (two read, two written), and whether the bits equal the
    default's. The residual GEMM (OPENINFER_RESIDUAL_GEMM=1) turns 72 add_rms_norm calls of a step
    into rms_norm calls, so this kernel's bandwidth is what it saves."""
    import cupy
    import numpy as np

    from openinfer.backend.cuda.backend import NORM_ROWS_PER_BLOCK, row_norm_vectors_per_lane
    from openinfer.backend.cuda.loader import kernel

    def time_launch(fn: Any, grid: tuple, block: tuple, arguments: tuple) -> float:
        return gpu_seconds(lambda: fn(grid, block, arguments), repeats, warmup=3)

    out_rows = []
    rng = np.random.default_rng(0)
    weight = cupy.asarray((rng.standard_normal(features).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16))
    for rows in rows_list:
        x = cupy.asarray((rng.standard_normal((rows, features)).astype(np.float32).view(np.uint32) >> 16)
                         .astype(np.uint16))
        residual = x[::-1].copy()
        vectors = row_norm_vectors_per_lane(features, x, weight)
        grid = (-(-rows // NORM_ROWS_PER_BLOCK),)
        block = (32 * NORM_ROWS_PER_BLOCK,)
        args = (np.int32(rows), np.int32(features), np.float32(1e-6))
        outputs = {}
        row: dict[str, Any] = {"rows": rows, "features": features}
        for name, defines in NORM_ROW_VARIANTS.items():
            fn = kernel("rms_norm.cu", "rms_norm_rows", VECS_PER_LANE=vectors, **defines)
            out = cupy.empty_like(x)
            seconds = time_launch(fn, grid, block, (x, weight, out, *args))
            outputs[name] = out
            row[f"{name}_us"] = seconds * 1e6
            row[f"{name}_tb_per_s"] = 2 * x.nbytes / seconds / 1e12
            row[f"{name}_same_bits"] = bool(cupy.array_equal(out, outputs["default"]))
        add = kernel("rms_norm.cu", "add_rms_norm_rows", VECS_PER_LANE=vectors)
        out, residual_out = cupy.empty_like(x), cupy.empty_like(x)
        seconds = time_launch(add, grid, block, (x, residual, weight, out, residual_out, *args))
        row["add_rms_norm_rows_us"] = seconds * 1e6
        row["add_rms_norm_rows_tb_per_s"] = 4 * x.nbytes / seconds / 1e12
        log("rms_norm_rows " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
        out_rows.append(row)
    return out_rows


def summarize(entry: dict[str, Any]) -> dict[str, Any]:
    kinds = breakdown(entry)
    total = entry["sum_device_s"]
    return {"phase": entry["phase"], "batch": entry["batch"], "tokens": entry["tokens"],
            "measured_ms": entry["measured_s"] * 1e3, "ops_sum_ms": total * 1e3,
            "gemm_ms": kinds.get(GEMM_KIND, 0.0) * 1e3, "non_gemm_ms": (total - kinds.get(GEMM_KIND, 0.0)) * 1e3,
            "by_kind_ms": {k: v * 1e3 for k, v in kinds.items()}, **({"held": entry["held"]} if "held" in entry else {})}


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# One mixed step vs one decode step: {report['name']}", "",
             f"Device: {report['device']}; copy {report['ceilings']['copy_bytes_per_s'] / 1e12:.2f} TB/s, cuBLAS bf16 "
             f"{report['ceilings']['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s (measured in the same run). "
             f"Written by `{report['command']}`.", ""]
    for entry, summary in zip(report["entries"], report["summaries"], strict=True):
        held = entry.get("held")
        held_text = (f" Device held while the host enqueues (events around the forward only): forward "
                     f"{held['forward_ms']:.3f} ms, with the batch's preparation {held['prepare_and_forward_ms']:.3f} ms "
                     f"(host enqueue {held['forward_enqueue_ms']:.1f} / {held['prepare_and_forward_enqueue_ms']:.1f} ms)."
                     if held else "")
        lines += [f"## {entry['title']}", "",
                  f"Measured step {summary['measured_ms']:.3f} ms ({entry['measured_how']}); ops sum "
                  f"{summary['ops_sum_ms']:.3f} ms = GEMMs {summary['gemm_ms']:.3f} + other {summary['non_gemm_ms']:.3f} ms."
                  + held_text, "", "| kind | ms | % of ops |", "|---|---:|---:|"]
        for kind, ms in summary["by_kind_ms"].items():
            lines.append(f"| {kind} | {ms:.3f} | {100 * ms / max(summary['ops_sum_ms'], 1e-12):.1f} |")
        lines += ["", "| op | kind | kernels | calls | ms | GB | GFLOP | % roofline | bound |",
                  "|---|---|---|---:|---:|---:|---:|---:|---|"]
        for row in entry["ops"]:
            if row["op"].startswith("(host"):
                continue
            pct = f"{row['roofline_pct']:.0f}" if row.get("roofline_pct") is not None else ""
            lines.append(f"| {row['op']} | {op_kind(row['op'])} | {', '.join(row['kernels'])} | {row['calls']} | "
                         f"{row['time_s'] * 1e3:.3f} | {row['bytes'] / 1e9:.3f} | {row['flops'] / 1e9:.1f} | {pct} | "
                         f"{row['bound']} |")
        lines.append("")
    for diff in report.get("comparisons", []):
        lines += [f"## {diff['title']}", "", "| op | base ms | ms | difference ms |", "|---|---:|---:|---:|"]
        lines += [f"| {r['op']} | {r['base_ms']:.3f} | {r['ms']:.3f} | {r['difference_ms']:+.3f} |"
                  for r in diff["ops"] if abs(r["difference_ms"]) >= 0.005]
        lines.append("")
    probe = report.get("overlap")
    if probe:
        lines += ["## Mixed attention of one layer: decode part beside the prefill part", "",
                  "| one stream (OPENINFER_MIXED_OVERLAP=0) | prefill part | decode part | sum | two streams "
                  "(the default) |", "|---:|---:|---:|---:|---:|",
                  f"| {probe['one_stream_us']:.1f} | {probe['prefill_part_us']:.1f} | {probe['decode_part_us']:.1f} | "
                  f"{probe['serial_sum_us']:.1f} | {probe['two_streams_us']:.1f} |", "",
                  f"(us, {probe['decode_rows']} decode rows)"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--random", choices=sorted(PRESETS), help="this shape, random weights (default qwen3-4b)")
    source.add_argument("--model-path", help="a checkpoint (or a config.json with --load-format dummy)")
    parser.add_argument("--load-format", choices=("auto", "dummy"), default=None)
    parser.add_argument("--checkpoint-dir", default="/tmp/openinfer-ledger", help="where --random writes its config")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--budget", type=int, default=8192, help="tokens per mixed step (the scheduler's budget)")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--decodes", type=_counts, default=[0, 8, 126, 200],
                        help="decode rows of each mixed step measured (0: prompts only, the comparisons' base)")
    parser.add_argument("--context", type=int, default=1088, help="the decodes' context")
    parser.add_argument("--decode-batch", type=_counts, default=[192, 224],
                        help="plain decode steps' batches (0: none; the largest is the engine's max_num_seqs, so "
                             "each is a CUDA graph bucket of its own size when it is one of the engine's buckets)")
    parser.add_argument("--decode-context", type=int, default=1088)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fused-rows", action="store_true",
                        help="keep norm + projection and silu·mul + projection as one ledger row each")
    parser.add_argument("--results-dir", default=str(RESULTS))
    parser.add_argument("--tag", default="", help="suffix of the output names (e.g. an opt-in measured)")
    parser.add_argument("--norm-rows-only", default="",
                        help="only time rms_norm_rows' variants at these row counts (e.g. 256,1024,8192,16384; "
                             "2560 features); writes norm_rows[_TAG].json")
    args = parser.parse_args(argv)
    if min(args.budget, args.prompt_len, args.context, args.repeats, args.decode_context) < 1:
        parser.error("--budget, --prompt-len, --context, --repeats and --decode-context must be positive")
    if max(args.decodes) >= args.budget:
        parser.error(f"--decodes must stay below --budget {args.budget}, got {args.decodes}")
    if args.tag and not args.tag.replace("-", "").replace("_", "").isalnum():
        parser.error(f"--tag takes letters, digits, '-' and '_', got {args.tag!r}")
    if args.device == "cuda":
        try:
            import cupy  # noqa: F401
        except ImportError:
            print("this benchmark times kernels on an NVIDIA GPU: CuPy is not installed (--device cpu checks it)",
                  file=sys.stderr)
            return 2
    if args.norm_rows_only:
        if args.device != "cuda":
            parser.error("--norm-rows-only times CUDA kernels")
        results = Path(args.results_dir)
        results.mkdir(parents=True, exist_ok=True)
        rows = norm_rows_variants(_counts(args.norm_rows_only), 2560, max(20, args.repeats))
        name = "norm_rows" + (f"_{args.tag}" if args.tag else "")
        (results / f"{name}.json").write_text(json.dumps({"variants": NORM_ROW_VARIANTS, "rows": rows}, indent=1) + "\n")
        log(f"wrote {results / name}.json")
        return 0

    from openinfer import create_engine

    preset = args.random or (None if args.model_path else "qwen3-4b")
    path = Path(args.checkpoint_dir) / preset if preset else Path(args.model_path)
    if preset:
        write_preset_config(preset, path)
    elif not (path / "config.json").is_file():
        parser.error(f"no config.json in --model-path {args.model_path!r}")
    shapes = {decodes: burst_step(decodes, args.budget, args.prompt_len, args.context) for decodes in args.decodes}
    mixed_blocks = max(sum(-(-c // BLOCK_SIZE) for c in contexts) for _, contexts in shapes.values())
    decode_batches = sorted({b for b in args.decode_batch if b > 0})
    decode_blocks = max(decode_batches, default=0) * -(-args.decode_context // BLOCK_SIZE)
    max_context = max(args.prompt_len, args.context, args.decode_context)
    max_seqs = max(len(new) for new, _ in shapes.values())
    engine = create_engine(str(path), device=args.device, max_num_seqs=max([max_seqs, *decode_batches]),
                           max_model_len=max_context + BLOCK_SIZE, num_kv_blocks=max(mixed_blocks, decode_blocks) + 2,
                           enable_prefix_cache=False, load_format=args.load_format or ("dummy" if preset else "auto"))
    results = Path(args.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    stem = "mixed_step" + (f"_{args.tag}" if args.tag else "")
    try:
        timer = Timer() if args.device == "cuda" else HostTimer()
        peak = ceilings(timer)
        backend = engine.model.backend
        if not args.fused_rows and not getattr(backend, "fuse_decode", False):
            # norm + projection and silu·mul + projection as their two ops (the same kernels the fused
            # ops launch here: they fuse only decode rows under OPENINFER_FUSED_DECODE=1), so the
            # norms and the activation get rows of their own instead of hiding in the GEMMs'
            backend.add_rms_norm_linear = None
            backend.silu_mul_linear = None
        ledger = Ledger(engine, timer, peak, args.repeats)
        report: dict[str, Any] = {
            "name": preset or path.name, "device": getattr(engine.model.backend, "device_name", "CPU (numpy)"),
            "command": "python benchmarks/gpu_mixed_step.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "ceilings": peak, "entries": [], "summaries": [], "comparisons": []}
        # the decode step first: the last step recorded is then the mixed step with the most decodes,
        # whose mixed attention calls the overlap probe replays
        steps = []
        for batch in decode_batches:
            steps.append((f"decode step: batch {batch} at context {args.decode_context}", "decode",
                          ledger.decode(batch, args.decode_context)))
        for decodes, (new, contexts) in sorted(shapes.items()):
            pieces = ", ".join(f"{n}" + (f" (of {c})" if c > n else "")
                               for n, c in zip(new[decodes:], contexts[decodes:], strict=True))
            steps.append((f"mixed step: {decodes} decodes at context {args.context} + prompt pieces {pieces}",
                          "mixed", step_batch(new, contexts, ledger.layout)))
        base = None
        for title, phase, host in steps:
            entry = ledger.measure(phase, host)
            entry["title"] = title
            if phase == "mixed" and args.device == "cuda":
                entry["held"] = held_forward(engine, timer, host, max(3, args.repeats))
                log(f"    device held: {entry['held']}")
            summary = summarize(entry)
            report["entries"].append(entry)
            report["summaries"].append(summary)
            log(f"{title}: measured {summary['measured_ms']:.3f} ms, ops {summary['ops_sum_ms']:.3f} ms = GEMM "
                f"{summary['gemm_ms']:.3f} + other {summary['non_gemm_ms']:.3f}")
            for kind, ms in summary["by_kind_ms"].items():
                log(f"    {kind:50s} {ms:9.3f} ms")
            if phase == "mixed" and base is None:
                base = entry
            elif phase == "mixed":
                report["comparisons"].append({"title": f"{title} against {base['title']}", "ops": compare(base, entry)})
        if args.device == "cuda":
            mixed_calls = [c for c in ledger.recorder.calls if c.name == "mixed_attention"]
            if mixed_calls:
                report["overlap"] = overlap_probe(mixed_calls[0], max(10, args.repeats))
                log("one layer's mixed attention (us): " + ", ".join(f"{k} {v:.1f}" for k, v in report["overlap"].items()))
            else:
                log("no mixed_attention call in the last step (fewer than 16 decodes, or the split off): no overlap probe")
    finally:
        engine.close_sync()
    (results / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    (results / f"{stem}.md").write_text(markdown(report))
    log(f"wrote {results / stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
