"""GPU serving figures for issue 6, in one process tree:

1. a Qwen3-4B-shaped checkpoint with random bf16 weights (speed does not depend on values) and a
   synthetic word-level tokenizer covering its whole vocabulary (so any sampled id detokenizes);
2. the device idle gap between decode steps, CUDA events around every step, with async
   scheduling on and off (64 requests, 1k in / 128 out, steady decoding);
3. ``benchmarks/serve.py`` against ``openinfer serve`` on that checkpoint: Poisson rate sweep to
   saturation and warm prefix-cache TTFT at 1k/4k/16k.

    python benchmarks/gpu_serving.py [--checkpoint /tmp/qwen3-4b-random] [--quick]
Writes benchmarks/results/idle_gap.json, serve_gpu.json/.png (copies under $OUT when set).
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="/tmp/qwen3-4b-random")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-serve", action="store_true")
    parser.add_argument("--skip-idle-gap", action="store_true")
    parser.add_argument("--idle-gap-mode", choices=["sync", "async"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
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
