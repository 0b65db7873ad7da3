"""Where a warm prefix-cache request's time goes on the host (CPU; no GPU needed).

A request whose prompt is cached but for its last few tokens should cost about one decode step.
Whatever the engine does on the host before and after that step is the same on a GPU, so this
measures it with the model's forward replaced by a stub that returns zero logits at once: a tiny
random Qwen3 with a 32k context, a cold request of ``--context`` tokens, then ``--warm`` requests
sharing all but the last 8 tokens. Reports each warm request's host TTFT and a profile of the
engine loop's steps (cumulative seconds per function, summed over the warm requests).

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--warm", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "warm_prefix_host.json"))
    args = parser.parse_args()

    import openinfer
    from openinfer.v1 import engine_pb2 as pb
    from tests.helpers.tiny_qwen3 import write_tiny_qwen3

    n = args.context
    path = write_tiny_qwen3(Path(tempfile.mkdtemp()) / "tiny", seed=0, max_position_embeddings=32768)
    engine = openinfer.create_engine(str(path), device="cpu", num_kv_blocks=n // 16 + 64, max_model_len=n + 64,
                                     max_num_batched_tokens=n + 16)
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

    async def run() -> tuple[float, list[float]]:
        cold = await one("cold")
        profiling["on"] = True
        return cold, [await one(f"warm{i}") for i in range(args.warm)]

    try:
        cold, warm = asyncio.run(run())
    finally:
        engine.close_sync()
    stats = pstats.Stats(profile)
    rows = []
    for (filename, line, function), (_, calls, _, cumulative, _) in stats.stats.items():
        if "openinfer" in filename or "/core/" in filename:
            rows.append({"function": f"{Path(filename).name}:{line}({function})", "calls": calls,
                         "cumulative_ms_per_request": 1e3 * cumulative / args.warm})
    rows.sort(key=lambda r: -r["cumulative_ms_per_request"])
    result = {"context": n, "cold_host_ttft_ms": 1e3 * cold, "warm_host_ttft_ms": [1e3 * w for w in warm],
              "warm_host_ttft_ms_median": 1e3 * float(np.median(warm)), "engine_step_profile": rows[:20],
              "note": "model forward stubbed: host time only; CPU of the machine that ran it"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"context {n}: warm host TTFT median {result['warm_host_ttft_ms_median']:.1f} ms")
    for row in rows[:14]:
        print(f"  {row['cumulative_ms_per_request']:8.2f} ms  {row['calls']:6d}  {row['function']}")


if __name__ == "__main__":
    main()
