"""Where a warm prefix-cache request's time goes on the host (CPU; no GPU needed).

A request whose prompt is cached but for its last few tokens should cost about one decode step.
Whatever the engine does on the host before and after that step is the same on a GPU, so this
measures it with the model's forward replaced by a stub that returns zero logits at once: a tiny
random Qwen3 with a 32k context, a cold request of ``--context`` tokens, then ``--warm`` requests
sharing all but the last 8 tokens. Reports each warm request's host TTFT and a profile of the
engine loop's steps (cumulative time per function, per warm request). ``--http`` sends the same
requests as token-id prompts to the HTTP app in-process (the demo model's tokenizer, vocab 49152)
and profiles the event loop's thread too: what the API server adds before and after the engine.

    python benchmarks/warm_prefix_host.py --context 16384 --out benchmarks/results/warm_prefix_host.json
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
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "warm_prefix_host.json"))
    args = parser.parse_args()

    import openinfer
    from openinfer.v1 import engine_pb2 as pb
    sys.path.insert(0, str(Path(__file__).parent))
    from model_shapes import TINY_QWEN3, write_config_dir

    n = args.context
    path = write_config_dir(Path(tempfile.mkdtemp()) / "tiny", TINY_QWEN3, max_position_embeddings=32768,
                            vocab_size=49152 if args.http else 96)
    if args.http:
        import shutil

        from openinfer.demo import ensure_demo_model

        demo = ensure_demo_model(progress=False)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(demo / name, path / name)
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

    async def one(request_id: str) -> float:
        began, first = time.perf_counter(), None
        request = pb.GenerateRequest(request_id=request_id, prompt_token_ids=prefix + rng.integers(3, 90, 8).tolist(),
                                     sampling=pb.SamplingParams(temperature=0.0),
                                     stop=pb.StopConditions(max_tokens=1, ignore_eos=True))
        async for event in engine.generate(request):
            if event.WhichOneof("event") == "tokens" and first is None:
                first = time.perf_counter() - began
        return first

    frontend_profile = cProfile.Profile()

    async def one_http(http, request_id: str) -> float:
        body = {"prompt": prefix + rng.integers(3, 90, 8).tolist(), "max_tokens": 1, "temperature": 0.0,
                "stream": True}
        began, first = time.perf_counter(), None
        async with http.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {") and first is None:
                    first = time.perf_counter() - began
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

        app = create_app(engine, Tokenizer.from_dir(path), "tiny")
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
    result = {"context": n, "through": "HTTP app (ASGI, token-id prompt, streamed)" if args.http else "EngineHandle",
              "cold_host_ttft_ms": 1e3 * cold, "warm_host_ttft_ms": [1e3 * w for w in warm],
              "warm_host_ttft_ms_median": 1e3 * float(np.median(warm)), "engine_step_profile": rows,
              "note": "model forward stubbed: host time only, on the CPU of the machine that ran it; TTFTs "
                      "unprofiled, profiles (cProfile, inflated by it) from a second round of the same requests"}
    if args.http:
        # the API server's own frames (the benchmark's client shares the loop and is left out)
        result["event_loop_profile"] = sorted(
            (row for row in top_all(frontend_profile) if any(k in row["function"] for k in SERVER_FRAMES)),
            key=lambda r: -r["cumulative_ms_per_request"])[:25]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"context {n}: warm host TTFT median {result['warm_host_ttft_ms_median']:.1f} ms")
    for name in ("engine_step_profile", "event_loop_profile"):
        if name in result:
            print(name)
            for row in result[name][:14]:
                print(f"  {row['cumulative_ms_per_request']:8.2f} ms  {row['calls']:6d}  {row['function']}")


if __name__ == "__main__":
    main()
