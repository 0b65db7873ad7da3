"""Cost of ``--trace-dir`` (openinfer.tracing) on the CPU.

Two measurements:

1. end to end: the demo model behind the HTTP app (in-process ASGI), ``--requests`` concurrent
   greedy completions, alternately with and without tracing, ``--rounds`` times each; the
   median wall time of each setting and their ratio;
2. the hooks alone: what ``EngineTracer`` costs per step at batch 1…256 (on_launch +
   on_resolved for every row, on_finish amortised over ``--tokens`` tokens per request, the
   writer thread's event building included as it shares the GIL);
3. the engine's own host step with the model's forward stubbed, tracing off and on, at batch
   1 / 64 / 256: tracing's share of the host work of a step (a GPU step is at least that long,
   so its share of a real step is smaller).

    python benchmarks/trace_overhead.py --out benchmarks/results/trace_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from openinfer import create_engine
from openinfer.demo import ensure_demo_model
from openinfer.frontend.http import create_app
from openinfer.tokenizer import Tokenizer
from openinfer.tracing import EngineTracer, TraceWriter

sys.path.insert(0, str(Path(__file__).parent))
from model_shapes import TINY_QWEN3, write_config_dir  # noqa: E402


def end_to_end(model_dir: Path, trace_dir: str | None, num_requests: int, max_tokens: int) -> float:
    engine = create_engine(str(model_dir), device="cpu", num_kv_blocks=512, trace_dir=trace_dir)
    app = create_app(engine, Tokenizer.from_dir(model_dir), "demo", trace_dir=trace_dir)
    prompts = [f"Request {i}: write a short story about a lighthouse keeper." for i in range(num_requests)]

    async def run() -> float:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://b", timeout=600) as http:
            await http.post("/v1/completions", json={"prompt": "warm up", "max_tokens": 2, "temperature": 0})
            began = time.perf_counter()
            responses = await asyncio.gather(*(http.post("/v1/completions", json={
                "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}) for p in prompts))
            elapsed = time.perf_counter() - began
            assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
            return elapsed

    try:
        return asyncio.run(run())
    finally:
        engine.close_sync()
        if engine.tracer is not None:
            engine.tracer.writer.flush()
            app.state.openinfer.tracer.writer.flush()


def hook_cost_per_step(batch: int, tokens_per_request: int, trace_dir: str, steps: int = 200) -> float:
    """Seconds the engine loop spends in tracer hooks per decode step at this batch size."""
    tracer = EngineTracer(TraceWriter(trace_dir))
    requests = [SimpleNamespace(request_id=f"r{batch}-{i}", num_prompt_tokens=16, num_computed_tokens=16)
                for i in range(batch)]
    chunks = [SimpleNamespace(request=r, start=16, num_tokens=1, samples=True) for r in requests]
    for r in requests:
        tracer.on_arrival(r.request_id)
        tracer.on_scheduled(r.request_id)
    began = time.perf_counter()
    for step in range(steps):
        record = tracer.on_launch(chunks)
        tracer.on_resolved(record)
        # a request finishes every tokens_per_request steps: spread those finishes evenly
        for r in requests[step * batch // tokens_per_request: (step + 1) * batch // tokens_per_request]:
            tracer.on_finish(r.request_id, "length", 16, steps, 0)
            tracer.on_arrival(r.request_id)
            tracer.on_scheduled(r.request_id)
    elapsed = (time.perf_counter() - began) / steps  # the engine thread's share; events are built by the writer
    tracer.writer.flush()
    return elapsed


def engine_host_step(model_dir: Path, batch: int, tokens: int, trace_dir: str | None) -> float:
    """Seconds per engine step with the model's forward stubbed (zero logits): the engine's own
    host work per step at this batch size, with or without tracing. On a GPU a step takes at
    least this long, so the tracing share of it bounds the share of a real step from above."""
    import numpy as np

    from openinfer.v1 import engine_pb2 as pb

    engine = create_engine(str(model_dir), device="cpu", num_kv_blocks=batch * (tokens // 16 + 3) + 8,
                           max_num_seqs=batch, trace_dir=trace_dir, load_format="dummy")
    vocab = engine.model.spec.vocab_size
    engine.model.forward = lambda device_batch, kv: np.zeros((len(device_batch.logits_rows), vocab), np.float32)

    async def one(i: int) -> None:
        request = pb.GenerateRequest(request_id=f"r{i}", prompt_token_ids=[3 + (i + j) % 50 for j in range(16)],
                                     sampling=pb.SamplingParams(temperature=0.0),
                                     stop=pb.StopConditions(max_tokens=tokens, ignore_eos=True))
        async for _ in engine.generate(request):
            pass

    async def run() -> float:
        began, steps = time.perf_counter(), engine.num_steps
        await asyncio.gather(*(one(i) for i in range(batch)))
        return (time.perf_counter() - began) / max(1, engine.num_steps - steps)

    try:
        return asyncio.run(run())
    finally:
        engine.close_sync()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "trace_overhead.json"))
    args = parser.parse_args()
    model_dir = ensure_demo_model(progress=False)
    times: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as trace_root:
        for round_index in range(args.rounds):
            for setting in ("off", "on") if round_index % 2 == 0 else ("on", "off"):
                trace_dir = f"{trace_root}/e2e{round_index}" if setting == "on" else None
                times[setting].append(end_to_end(model_dir, trace_dir, args.requests, args.tokens))
                print(f"round {round_index} tracing {setting}: {times[setting][-1]:.3f} s", flush=True)
        num_files = len(list(Path(trace_root).glob("e2e0/*.json")))
        tiny = write_config_dir(Path(trace_root) / "tiny", TINY_QWEN3)
        steps: dict[str, dict[str, list[float]]] = {}
        for b in (1, 64, 256):
            steps[str(b)] = {"off": [], "on": []}
            for round_index in range(args.rounds):
                for setting in ("off", "on") if round_index % 2 == 0 else ("on", "off"):
                    trace_dir = f"{trace_root}/steps{b}-{round_index}" if setting == "on" else None
                    steps[str(b)][setting].append(engine_host_step(tiny, b, args.tokens * 4, trace_dir))
            print(f"engine host step bs={b}: off {statistics.median(steps[str(b)]['off']) * 1e3:.2f} ms, "
                  f"on {statistics.median(steps[str(b)]['on']) * 1e3:.2f} ms", flush=True)
        hooks = {b: hook_cost_per_step(b, args.tokens, f"{trace_root}/hooks{b}") for b in (1, 8, 64, 256)}
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    result = {
        "what": f"{args.requests} concurrent greedy completions x {args.tokens} tokens, demo model, CPU, HTTP app",
        "wall_s": times, "median_off_s": off, "median_on_s": on, "overhead_pct": 100 * (on / off - 1),
        "trace_files_per_round": num_files,
        "hook_us_per_step": {str(b): round(t * 1e6, 2) for b, t in hooks.items()},
        "engine_host_step_s": steps,
        # tracing's share of the engine's own host work per step (model forward stubbed)
        "engine_host_step_overhead_pct": {
            b: round(100 * (statistics.median(v["on"]) / statistics.median(v["off"]) - 1), 2) for b, v in steps.items()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
