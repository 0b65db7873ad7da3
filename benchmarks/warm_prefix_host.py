"""Where a warm prefix-cache request's time goes on the host (CPU; no GPU needed).

A request whose prompt is cached but for its last few tokens should cost about one decode step.
Whatever the engine does on the host before and after that step is the same on a GPU, so this
measures it with the model's forward replaced by a stub that returns zero logits at once: a tiny
random Qwen3 with a 32k context, a cold request of ``--context`` tokens, then ``--warm`` requests
sharing all but the last 8 tokens. Reports each warm request's host TTFT and a profile of the
engine loop's steps (cumulative time per function, per warm request). ``--http`` sends the same
requests as token-id prompts to the HTTP app in-process (the demo model's tokenizer, vocab 49152)
and profiles the event loop's thread too: what the API server adds before and after the engine
(``--text``: the prompt as text, which the server tokenizes). Bodies are JSON-encoded before each
request's clock starts, as a client in another process would. ``--serve``: the whole served path
instead, ``openinfer serve`` (an API-server process and the engine-core process) with the stub
engine (``openinfer.engine_core.stub``, a fixed ``--stub-step-ms`` per step), cold and warm TTFT
rows of benchmarks/serve.py's lean client at each ``--contexts`` length: warm TTFT minus the stub
step is the host's part of a warm request on this machine's CPU. ``--device cuda``: the engine path
with a Qwen3-4B-shaped model on the GPU instead of the stub (random weights, short-prefill graphs
on): the warm TTFT with its real device step, and where the engine's step spends its host time
around it.

    python benchmarks/warm_prefix_host.py --context 16384 --out benchmarks/results/warm_prefix_host.json
    python benchmarks/warm_prefix_host.py --serve --contexts 1024 16384 --out /tmp/warm_prefix_serve.json
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


SERVER_FRAMES = ("/frontend/", "/http/", "pydantic", "fastapi/routing", "tokenizer", "json/", "validation")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--warm", type=int, default=5)
    parser.add_argument("--http", action="store_true", help="through the HTTP app (in-process ASGI)")
    parser.add_argument("--text", action="store_true", help="with --http: the prompt as text (the prefix's ids "
                                                              "decoded), tokenized by the server")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "warm_prefix_host.json"))
    parser.add_argument("--compare", help="a JSON of an earlier run (e.g. before a change): plotted next to "
                                          "this one in a PNG beside --out")
    parser.add_argument("--serve", action="store_true", help="the served path: openinfer serve with the stub engine")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 16384], help="with --serve: prompt lengths")
    parser.add_argument("--repeats", type=int, default=7, help="with --serve: fresh prompts per context (median)")
    parser.add_argument("--stub-step-ms", type=float, default=1.0, help="with --serve: the stub's device step")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the engine path (no --http/--serve) with a Qwen3-4B-shaped model on the GPU "
                             "(random weights, short-prefill graphs on) instead of the stubbed tiny model: the host "
                             "work around a real warm step, the device step included in the TTFT")
    args = parser.parse_args()
    if args.device == "cuda" and (args.http or args.serve):
        parser.error("--device cuda measures the engine path only (no --http / --serve)")
    if args.serve:
        if args.repeats < 1 or any(c < 2 for c in args.contexts) or args.stub_step_ms < 0:
            parser.error("--repeats >= 1, --contexts >= 2 tokens each, --stub-step-ms >= 0")
        serve_rows(args)
        return

    import openinfer
    from openinfer.v1 import engine_pb2 as pb
    sys.path.insert(0, str(Path(__file__).parent))
    from model_shapes import TINY_QWEN3, write_config_dir

    n = args.context
    if args.device == "cuda":
        import os

        from gpu_bench import QWEN3_4B

        os.environ.setdefault("OPENINFER_PREFILL_GRAPHS", "1")  # the warm step's short-prefill graph
        path = write_config_dir(Path(tempfile.mkdtemp()) / "qwen3-4b", {
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **QWEN3_4B, "bos_token_id": 1,
            "eos_token_id": 2}, max_position_embeddings=max(32768, n + 64))
    else:
        path = write_config_dir(Path(tempfile.mkdtemp()) / "tiny", TINY_QWEN3, max_position_embeddings=32768,
                                vocab_size=49152 if args.http else 96)
    if args.http:
        import shutil

        tokenizer_dir = demo_or_generated_tokenizer(Path(tempfile.mkdtemp()))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_dir / name, path / name)
    if args.device == "cuda":
        engine = openinfer.create_engine(str(path), device="cuda", max_model_len=n + 64, max_num_seqs=1,
                                         load_format="dummy")
    else:
        engine = openinfer.create_engine(str(path), device="cpu", num_kv_blocks=n // 16 + 64, max_model_len=n + 64,
                                         max_num_batched_tokens=n + 16, load_format="dummy")
        vocab = engine.model.spec.vocab_size
        engine.model.forward = lambda batch, kv: np.zeros((len(batch.logits_rows), vocab), np.float32)
    profile = cProfile.Profile()
    step = engine.step
    profiling = {"on": False}

    def profiled_step() -> None:
        if not profiling["on"]:
            return step()
        profile.enable()
        try:
            return step()
        finally:
            profile.disable()

    engine.step = profiled_step
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, 90, n - 8).tolist()

    cpu_ms: list[float] = []  # CPU time of the whole process (every thread) to each warm first token

    async def one(request_id: str) -> float:
        # the prompt as the int32 array beside the request, as the engine core receives it
        prompt = np.array(prefix + rng.integers(3, 90, 8).tolist(), np.int32)
        began, began_cpu, first = time.perf_counter(), time.process_time(), None
        request = pb.GenerateRequest(request_id=request_id, sampling=pb.SamplingParams(temperature=0.0),
                                     stop=pb.StopConditions(max_tokens=1, ignore_eos=True))
        async for event in engine.generate_prompt_array(request, prompt):
            if event.WhichOneof("event") == "tokens" and first is None:
                first = time.perf_counter() - began
                if not profiling["on"]:
                    cpu_ms.append(1e3 * (time.process_time() - began_cpu))
        return first

    frontend_profile = cProfile.Profile()

    text_prefix = {}  # --text: the prefix as text (decoded once), each request adding a few words

    async def one_http(http, request_id: str) -> float:
        suffix = rng.integers(3, 90, 8).tolist()
        prompt = text_prefix["text"] + " " + " ".join(map(str, suffix)) if args.text else prefix + suffix
        # encoded before the clock starts: a real client does that in its own process
        body = json.dumps({"prompt": prompt, "max_tokens": 1, "temperature": 0.0, "stream": True}).encode()
        began, began_cpu, first = time.perf_counter(), time.process_time(), None
        async with http.stream("POST", "/v1/completions", content=body,
                               headers={"content-type": "application/json"}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {") and first is None:
                    first = time.perf_counter() - began
                    if not profiling["on"]:
                        cpu_ms.append(1e3 * (time.process_time() - began_cpu))
        return first

    async def run() -> tuple[float, list[float]]:
        """TTFTs unprofiled; then the same warm requests again under the profilers."""
        if not args.http:
            cold = await one("cold")
            warm = [await one(f"warm{i}") for i in range(args.warm)]
            profiling["on"] = True
            for i in range(args.warm):
                await one(f"profiled{i}")
            return cold, warm
        import httpx

        from openinfer.frontend.http import create_app
        from openinfer.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_dir(path)
        text_prefix["text"] = tokenizer.decode(prefix)
        app = create_app(engine, tokenizer, "tiny")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://b", timeout=600) as http:
            cold = await one_http(http, "cold")
            warm = [await one_http(http, f"warm{i}") for i in range(args.warm)]
            profiling["on"] = True
            frontend_profile.enable()
            for i in range(args.warm):
                await one_http(http, f"profiled{i}")
            frontend_profile.disable()
            return cold, warm

    try:
        cold, warm = asyncio.run(run())
    finally:
        engine.close_sync()

    def top(profile: cProfile.Profile, keep: str) -> list[dict]:
        rows = []
        for (filename, line, function), (_, calls, _, cumulative, _) in pstats.Stats(profile).stats.items():
            if keep in filename:
                rows.append({"function": f"{Path(filename).name}:{line}({function})", "calls": calls,
                             "cumulative_ms_per_request": 1e3 * cumulative / args.warm})
        return sorted(rows, key=lambda r: -r["cumulative_ms_per_request"])[:20]

    def top_all(profile: cProfile.Profile) -> list[dict]:
        return [{"function": f"{filename}:{line}({function})", "calls": calls,
                 "cumulative_ms_per_request": 1e3 * cumulative / args.warm}
                for (filename, line, function), (_, calls, _, cumulative, _) in pstats.Stats(profile).stats.items()]

    rows = top(profile, str(Path(openinfer.__file__).resolve().parent))  # the package's own frames
    if args.device == "cuda":  # and the plugins' and CuPy's (a device wait shows as a CuPy frame)
        rows = sorted(rows + [r for r in top_all(profile) if "/plugins/" in r["function"] or "cupy" in r["function"]],
                      key=lambda r: -r["cumulative_ms_per_request"])[:30]
    result = {"context": n, "device": args.device,
              "through": (f"HTTP app (ASGI, {'text' if args.text else 'token-id'} prompt, streamed)" if args.http
                          else "EngineHandle"),
              "cold_host_ttft_ms": 1e3 * cold, "warm_host_ttft_ms": [1e3 * w for w in warm],
              "warm_host_ttft_ms_median": 1e3 * float(np.median(warm)),
              "warm_host_ttft_ms_min": 1e3 * float(np.min(warm)), "engine_step_profile": rows,
              "note": ("Qwen3-4B-shaped model on the GPU: TTFT = host work + the device step" if args.device == "cuda"
                       else "model forward stubbed: host time only") + ", on the CPU of the machine that ran it; "
                      "TTFTs unprofiled, profiles (cProfile, inflated by it) from a second round of the same requests"}
    if cpu_ms:  # robust where the machine is shared: wall time includes waiting for a core
        result["warm_process_cpu_ms"] = cpu_ms[1:]
        result["warm_process_cpu_ms_median"] = float(np.median(cpu_ms[1:]))
    if args.http:
        # the API server's own frames (the benchmark's client shares the loop and is left out)
        result["event_loop_profile"] = sorted(
            (row for row in top_all(frontend_profile) if any(k in row["function"] for k in SERVER_FRAMES)),
            key=lambda r: -r["cumulative_ms_per_request"])[:25]
        # the outermost server frame: the API server's CPU on the event loop per request (profiled),
        # the engine's thread and the tokenizer's worker threads left out
        result["warm_server_event_loop_ms_profiled"] = result["event_loop_profile"][0]["cumulative_ms_per_request"]
    if args.compare:
        result["compared_with"] = {"path": args.compare, **{k: v for k, v in json.loads(Path(args.compare).read_text()).items()
                                                           if k.startswith(("warm_", "cold_"))}}
        plot_comparison(result, Path(args.out).with_suffix(".png"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"context {n}: warm host TTFT median {result['warm_host_ttft_ms_median']:.1f} ms, "
          f"min {result['warm_host_ttft_ms_min']:.1f} ms; process CPU per warm request median "
          f"{result.get('warm_process_cpu_ms_median', float('nan')):.1f} ms")
    for name in ("engine_step_profile", "event_loop_profile"):
        if name in result:
            print(name)
            for row in result[name][:14]:
                print(f"  {row['cumulative_ms_per_request']:8.2f} ms  {row['calls']:6d}  {row['function']}")


def serve_rows(args: argparse.Namespace) -> None:
    """Cold and warm TTFT rows through ``openinfer serve`` with the stub engine."""
    import os
    import signal
    import subprocess

    sys.path.insert(0, str(Path(__file__).parent))
    from gpu_concurrency import free_port, wait_ready
    from serve import ttft_rows

    from openinfer.engine_core.stub import FACTORY_SPEC, write_stub_model

    max_len = max(args.contexts) + 64
    work = Path(tempfile.mkdtemp())
    tokenizer_dir = demo_or_generated_tokenizer(work)
    checkpoint = write_stub_model(work / "stub", tokenizer_dir, step_ms=args.stub_step_ms, max_model_len=max_len)
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    port = free_port()
    command = [sys.executable, "-m", "openinfer.cli", "serve", "--model-path", str(checkpoint), "--port", str(port),
               "--grpc-port", "0", "--max-model-len", str(max_len), "--api-server-count", "1", "--log-level",
               "warning", "--engine-factory", FACTORY_SPEC, "--device", "cpu",
               "--num-kv-blocks", str(4 * max_len // 16 + 64)]
    process = subprocess.Popen(command, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, process, 300)
        import httpx

        model = httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]
        rows = ttft_rows(url, model, args.contexts, args.repeats, vocab)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(30)
    for row in rows:
        row["warm_host_ms"] = row["warm_ttft_ms"] - args.stub_step_ms
        row["warm_host_ms_min"] = min(row["warm_ttft_ms_each"], default=float("nan")) - args.stub_step_ms
    result = {"through": "openinfer serve (API server + engine-core processes), stub engine", "stub_step_ms":
              args.stub_step_ms, "ttft": rows, "note": "warm_host_ms = warm TTFT - the stub's step; this CPU"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for row in rows:
        print(f"context {row['context']}: warm TTFT {row['warm_ttft_ms']:.2f} ms (min "
              f"{row['warm_host_ms_min'] + args.stub_step_ms:.2f}), host part {row['warm_host_ms']:.2f} ms; "
              f"cold {row['cold_ttft_ms']:.2f} ms; cached {row['warm_cached_tokens']}")


def demo_or_generated_tokenizer(work: Path) -> Path:
    """The demo model's tokenizer directory, or (a GPU machine without the demo package) a
    generated word-level one under ``work`` (vocab 32000)."""
    from openinfer.demo import ensure_demo_model
    from openinfer.errors import DemoModelUnavailableError

    try:
        return ensure_demo_model(progress=False)
    except DemoModelUnavailableError:
        sys.path.insert(0, str(Path(__file__).parent))
        from gpu_serving import write_tokenizer

        tokenizer_dir = work / "tokenizer"
        tokenizer_dir.mkdir()
        write_tokenizer(tokenizer_dir, 32000)
        return tokenizer_dir


def plot_comparison(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    before = result["compared_with"]
    names = ["warm TTFT median", "warm TTFT min", "process CPU per warm request", "server event loop\n(profiled)"]
    keys = ["warm_host_ttft_ms_median", "warm_host_ttft_ms_min", "warm_process_cpu_ms_median",
            "warm_server_event_loop_ms_profiled"]
    x = np.arange(len(names))
    figure, axes = plt.subplots(figsize=(8.5, 3.8))
    axes.bar(x - 0.2, [before.get(k, np.nan) for k in keys], 0.4, label=f"earlier ({Path(before['path']).name})")
    axes.bar(x + 0.2, [result.get(k, np.nan) for k in keys], 0.4, label="this run")
    axes.set_xticks(x, names)
    axes.set_ylabel("ms")
    axes.set_title(f"warm {result['context']}-token prefix, host path (forward stubbed)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
