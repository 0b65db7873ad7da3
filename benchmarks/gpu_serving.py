"""GPU serving figures for issue 6, in one process tree:

1. a Qwen3-4B-shaped checkpoint with random bf16 weights (speed does not depend on values) and a
   synthetic word-level tokenizer covering its whole vocabulary (so any sampled id detokenizes);
2. the device idle gap between decode steps, CUDA events around every step, with async
   scheduling on and off (64 requests, 1k in / 128 out, steady decoding);
3. ``benchmarks/serve.py`` against ``openinfer serve`` on that checkpoint: Poisson rate sweep to
   saturation and warm prefix-cache TTFT at 1k/4k/16k.

    python benchmarks/gpu_serving.py [--checkpoint /tmp/qwen3-4b-random] [--quick]
Writes benchmarks/results/idle_gap.json, serve_gpu.json/.png (copies under $OUT when set).

``--warm-prefix-engine`` measures only the warm prefix-cache TTFT, in process through the
engine (no HTTP, no checkpoint on disk: ``load_format="dummy"``), at ``--contexts``: a cold
request, then warm requests sharing all but its last 8 tokens (so the step runs the last 16
tokens over the cached blocks), each round's prompt sent with the short-prefill CUDA graphs off
(eager) and on (``OPENINFER_PREFILL_GRAPHS=1``, ``CudaGraphRunner.use_prefill_graphs``) in
alternating order, their greedy first tokens compared. Writes benchmarks/results/warm_prefix_gpu.json/.png (under $OUT instead when set)::

    OPENINFER_SHORT_QUERY_ATTENTION=1 python benchmarks/gpu_serving.py --warm-prefix-engine
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def write_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def measure_idle_gap(checkpoint: Path, async_scheduling: bool, num_requests: int, input_len: int,
                     output_len: int) -> dict:
    import numpy as np

    import openinfer
    from openinfer.offline import collect, generate_request, run_requests

    engine = openinfer.create_engine(checkpoint, device="cuda", async_scheduling=async_scheduling,
                                     max_model_len=4096)
    rng = np.random.default_rng(0)
    warm = [generate_request(f"w{i}", rng.integers(100, 150000, size=64).tolist(), max_tokens=8) for i in range(4)]
    run_requests(engine, warm)
    prompts = [rng.integers(100, 150000, size=input_len).tolist() for _ in range(num_requests)]
    requests = [generate_request(f"r{i}", p, max_tokens=output_len) for i, p in enumerate(prompts)]
    # time only the steady decode phase: reset the events once every prompt is prefilled
    timer = engine.step_timer

    async def main():
        tasks = [asyncio.ensure_future(collect(engine, r)) for r in requests]
        while engine.num_steps < 3 or any(r.in_prefill for r in engine.scheduler.running) or engine.scheduler.waiting:
            await asyncio.sleep(0.005)
        timer.reset()
        start = time.perf_counter()
        steps_before = engine.num_steps
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start, engine.num_steps - steps_before

    results, seconds, steps = asyncio.run(main())
    report = timer.report()
    report.update({"async_scheduling": async_scheduling, "decode_steps": steps, "decode_seconds": seconds,
                   "wall_ms_per_step": 1e3 * seconds / max(steps, 1), "num_requests": num_requests,
                   "tokens": sum(len(r.token_ids) for r in results),
                   "launched_ahead": engine.num_steps_launched_ahead})
    engine.close_sync()
    return report


def start_phases(engine: object, start_seconds: float) -> dict[str, float]:
    """The engine's start-up phases (KV planning and allocation, kernel compile, decode and
    short-prefill graph capture) plus ``model_load``, the rest of ``start_seconds`` (plugin,
    weights; random ones under ``load_format="dummy"``)."""
    phases = {k: float(v) for k, v in getattr(engine, "startup_phases", {}).items()}
    return {"model_load": max(0.0, start_seconds - sum(phases.values())), **phases}


def measure_warm_prefix(contexts: list[int], repeats: int, out_dirs: list[Path], device: str = "cuda",
                        tiny: bool = False, max_num_seqs: int = 1) -> dict:
    """Warm prefix TTFT through the engine, short-prefill graphs off and on (see the docstring);
    the JSON is rewritten after each context, so a run cut short keeps what it measured.
    ``max_num_seqs`` sets the graph buckets captured at start (1: one decode and one
    short-prefill graph; 256, the serving default: 13 and 7)."""
    import tempfile

    import numpy as np

    os.environ.setdefault("OPENINFER_PREFILL_GRAPHS", "1")  # capture them; the runner's switch picks per request
    from gpu_bench import QWEN3_4B
    from model_shapes import TINY_QWEN3, write_config_dir

    import openinfer
    from openinfer.v1 import engine_pb2 as pb

    config = {**TINY_QWEN3, "max_position_embeddings": 32768} if tiny else {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **QWEN3_4B, "bos_token_id": 1, "eos_token_id": 2}
    path = write_config_dir(Path(tempfile.mkdtemp()) / "qwen3-4b", config)
    began = time.perf_counter()
    # the requests run one at a time; max_num_seqs only sets which graphs the start captures
    options = dict(device=device, load_format="dummy", max_model_len=max(contexts) + 64, max_num_seqs=max_num_seqs)
    capture_error = None
    try:
        engine = openinfer.create_engine(str(path), **options)
    except Exception as exc:  # a failed short-prefill capture still leaves the eager numbers to measure
        if os.environ["OPENINFER_PREFILL_GRAPHS"] != "1":
            raise
        capture_error = f"{type(exc).__name__}: {exc}"
        print(f"engine with short-prefill graphs failed ({capture_error}); measuring without them", flush=True)
        os.environ["OPENINFER_PREFILL_GRAPHS"] = "0"
        engine = openinfer.create_engine(str(path), **options)
    runner = engine.runner
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout.strip() if shutil.which("nvidia-smi") else ""
    gpu = gpu or "unknown GPU"
    start_seconds = time.perf_counter() - began
    phases = start_phases(engine, start_seconds)
    report: dict = {"device": gpu if device == "cuda" else "cpu (dry run)",
                    "model": f"{'tiny Qwen3' if tiny else 'Qwen3-4B-shaped'}, random weights (load_format dummy)",
                    "through": "EngineHandle in process (no HTTP)", "engine_start_s": start_seconds,
                    "max_num_seqs": max_num_seqs, "decode_graph_buckets": sorted(getattr(runner, "graphs", {})),
                    "short_query_attention": os.environ.get("OPENINFER_SHORT_QUERY_ATTENTION", "default"),
                    "prefill_graph_buckets": sorted(getattr(runner, "prefill_graphs", {})),
                    "prefill_graph_capture_error": capture_error,
                    "engine_start_phases_s": phases,
                    # the same engine without short-prefill graphs skips exactly that phase
                    "engine_start_without_prefill_graphs_s": start_seconds - phases.get("prefill_graph_capture", 0.0),
                    "contexts": []}
    launches: list[tuple[int, int, bool, float]] = []  # (tokens, max query, graphed, launch ms) of the last request
    outer = runner.observer

    def observe(batch, graphed, start, end):
        launches.append((batch.num_tokens, batch.max_query_len, graphed, 1e3 * (end - start)))
        if outer is not None:
            outer(batch, graphed, start, end)

    runner.observer = observe
    print(f"engine started in {start_seconds:.1f} s ({', '.join(f'{k} {v:.2f} s' for k, v in phases.items())}); "
          f"decode graphs {report['decode_graph_buckets'] or 'none'}, short-prefill graphs "
          f"{report['prefill_graph_buckets'] or 'none'}", flush=True)
    rng = np.random.default_rng(0)
    vocab = config["vocab_size"]

    async def ttft(prompt: list[int], name: str) -> dict:
        launches.clear()
        request = pb.GenerateRequest(request_id=name, prompt_token_ids=prompt,
                                     sampling=pb.SamplingParams(temperature=0.0),
                                     stop=pb.StopConditions(max_tokens=1, ignore_eos=True))
        start, first, token = time.perf_counter(), None, None
        async for event in engine.generate(request):
            if event.WhichOneof("event") == "tokens" and first is None:
                first = time.perf_counter() - start
                token = int(event.tokens.ids[0])
        tokens, query, graphed, launch_ms = launches[-1] if launches else (0, 0, False, float("nan"))
        return {"ttft_ms": 1e3 * first, "token": token, "step_tokens": tokens, "step_max_query": query,
                "graphed": graphed, "launch_ms": launch_ms}

    async def run() -> None:
        for context in contexts:
            prefix = rng.integers(100, vocab - 100, context - 8).tolist()
            cold_prompt = prefix + rng.integers(100, vocab - 100, 8).tolist()
            row: dict = {"context": context, "cold": await ttft(cold_prompt, f"cold{context}")}
            modes = {"eager": False, "graph": True} if getattr(runner, "prefill_graphs", None) else {"eager": False}
            samples: dict[str, list[dict]] = {m: [] for m in modes}
            same_token = 0
            for i in range(repeats + 1):  # the first round warms up (kernels, pool); alternate the order
                # one prompt per round for every mode: the second request finds the whole prompt
                # cached and recomputes the same last 16 tokens, so the greedy tokens must agree
                prompt = prefix + rng.integers(100, vocab - 100, 8).tolist()
                tokens = set()
                for mode in (list(modes) if i % 2 else list(modes)[::-1]):
                    runner.use_prefill_graphs = modes[mode]
                    sample = await ttft(prompt, f"w{context}{mode}{i}")
                    tokens.add(sample["token"])
                    if i:
                        samples[mode].append(sample)
                same_token += len(tokens) == 1
            runner.use_prefill_graphs = True
            row["rounds_with_equal_greedy_tokens"] = f"{same_token} of {repeats + 1}"
            for mode, rows in samples.items():
                ms = [r["ttft_ms"] for r in rows]
                row[f"warm_{mode}"] = {"ttft_ms": ms, "ttft_ms_median": float(np.median(ms)),
                                       "ttft_ms_min": float(np.min(ms)), "step": {k: rows[-1][k] for k in rows[-1]
                                                                                  if k != "ttft_ms"}}
            report["contexts"].append(row)
            summary = {k: v["ttft_ms_median"] for k, v in row.items() if isinstance(v, dict) and "ttft_ms_median" in v}
            print(f"context {context}: cold {row['cold']['ttft_ms']:.1f} ms, warm TTFT medians {summary}, greedy "
                  f"tokens equal across modes in {row['rounds_with_equal_greedy_tokens']} rounds", flush=True)
            for out in out_dirs:
                out.mkdir(parents=True, exist_ok=True)
                (out / "warm_prefix_gpu.json").write_text(json.dumps(report, indent=2))

    try:
        asyncio.run(run())
    finally:
        engine.close_sync()
    for out in out_dirs:
        plot_warm_prefix(report, out / "warm_prefix_gpu.png")
    return report


def plot_warm_prefix(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = report["contexts"]
    series = [k for k in ("warm_eager", "warm_graph") if any(k in r for r in rows)]
    x = np.arange(len(rows))
    width = 0.8 / max(1, len(series))
    figure, axes = plt.subplots(figsize=(7, 4))
    for i, name in enumerate(series):
        axes.bar(x + i * width, [r.get(name, {}).get("ttft_ms_median", 0.0) for r in rows], width, label=name)
    axes.axhline(10, color="gray", linestyle="--", linewidth=1, label="goal 10 ms")
    axes.set_xticks(x + 0.4 - width / 2, [str(r["context"]) for r in rows])
    axes.set_xlabel("context tokens")
    axes.set_ylabel("TTFT ms (median)")
    axes.set_title(f"warm prefix TTFT, {report['model'].split(',')[0]}, {report['device']}", fontsize=9)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="/tmp/qwen3-4b-random")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-serve", action="store_true")
    parser.add_argument("--skip-idle-gap", action="store_true")
    parser.add_argument("--idle-gap-mode", choices=["sync", "async"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--warm-prefix-engine", action="store_true",
                        help="only the warm prefix TTFT through the engine, prefill graphs off/on")
    parser.add_argument("--contexts", default="1024,4096,16384")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of --warm-prefix-engine (with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="a tiny Qwen3 instead of the Qwen3-4B shape")
    parser.add_argument("--max-num-seqs", type=int, default=1,
                        help="--warm-prefix-engine: the engine's max_num_seqs, which sets the graphs captured at "
                             "start (256 is the serving default)")
    args = parser.parse_args()
    if args.warm_prefix_engine:
        out = [Path(os.environ["OUT"])] if os.environ.get("OUT") else [HERE / "results"]
        if args.max_num_seqs < 1:
            parser.error("--max-num-seqs must be at least 1")
        measure_warm_prefix([int(c) for c in args.contexts.split(",") if c], args.repeats, out, args.device, args.tiny,
                            args.max_num_seqs)
        return
    checkpoint = Path(args.checkpoint)
    if not (checkpoint / "config.json").exists():
        # in a child process, so torch's CUDA memory is gone before our engine sizes its KV pool
        subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                        "from pathlib import Path; from gpu_cold_start import write_checkpoint; "
                        "print(f'wrote random checkpoint in {write_checkpoint(Path(sys.argv[2])):.1f}s')",
                        str(HERE), str(checkpoint)], check=True)
    if not (checkpoint / "tokenizer.json").exists():
        write_tokenizer(checkpoint, json.loads((checkpoint / "config.json").read_text())["vocab_size"])
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    results = HERE / "results"
    results.mkdir(exist_ok=True)

    if args.idle_gap_mode is not None:  # child process: one engine, one mode, one JSON line
        print("IDLE_GAP " + json.dumps(measure_idle_gap(checkpoint, args.idle_gap_mode == "async", 64, 1024, 128)))
        return
    gaps = []
    for mode in ("sync", "async") if not args.skip_idle_gap else ():  # each engine in its own process: it takes most of the GPU
        child = subprocess.run([sys.executable, __file__, "--checkpoint", str(checkpoint), "--idle-gap-mode", mode],
                               capture_output=True, text=True)
        if child.returncode != 0:
            raise RuntimeError(f"idle-gap run ({mode}) failed:\n{child.stderr[-4000:]}")
        gaps.append(json.loads(next(line[9:] for line in child.stdout.splitlines() if line.startswith("IDLE_GAP "))))
        print(json.dumps(gaps[-1]), flush=True)
    device = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                            text=True).stdout.strip() or "unknown GPU"
    if gaps:
        (results / "idle_gap.json").write_text(json.dumps({"device": device, "runs": gaps}, indent=2))
        if out:
            shutil.copy(results / "idle_gap.json", out)
    if args.skip_serve:
        return
    rates = "4,16,inf" if args.quick else "2,4,8,16,32,64,inf"
    num = "96" if args.quick else "256"
    command = [sys.executable, str(HERE / "serve.py"), "--launch", "--url", "http://127.0.0.1:8123",
               "--model-path", str(checkpoint), "--serve-args", "--device cuda --max-model-len 17000",
               "--input-len", "1024", "--output-len", "128", "--num-requests", num, "--rates", rates,
               "--prefix-contexts", "1024,4096,16384", "--vocab-size", "151936", "--device-name", device,
               "--tag", "serve_gpu"]
    subprocess.run(command, check=True)
    if out:
        for name in ("serve_gpu.json", "serve_gpu.png"):
            shutil.copy(results / name, out)


if __name__ == "__main__":
    main()
