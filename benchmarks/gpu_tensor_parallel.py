"""Tensor parallel on GPUs: a Qwen3-8B-shaped model (dummy bf16 weights, ``--load-format dummy``)
served at TP=1 and TP=2 on the same machine — decode TPOT at batch 1 and 64, and the TTFT of
a 4096-token prefill — through the whole engine (ranks as processes, NCCL, CUDA graphs).

    NCCL_NVLS_ENABLE=0 python benchmarks/gpu_tensor_parallel.py [--out DIR] [--sizes 1,2]
    python benchmarks/gpu_tensor_parallel.py --tiny --device cpu   # CPU smoke run (CI)

Writes ``tensor_parallel.json`` (+ ``tensor_parallel.png`` when matplotlib is present) to
``--out`` (default benchmarks/results; ``tensor_parallel_tiny.*`` with ``--tiny``, a tiny model,
batches and prefill so the same code runs in seconds). Scaling efficiency = speedup / TP.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ["NCCL_NVLS_ENABLE"] = "0"
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
}
TINY_QWEN3 = {**QWEN3_8B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "bos_token_id": 0,
              "eos_token_id": 1}
DECODE_PROMPT = 128
DECODE_TOKENS = 128
PREFILL_TOKENS = 4096


async def _timed(engine, request) -> list[float]:
    """Arrival time of every generated token."""
    times: list[float] = []
    async for event in engine.generate(request):
        kind = event.WhichOneof("event")
        if kind == "tokens":
            now = time.perf_counter()
            times.extend([now] * len(event.tokens.ids))
        elif kind == "error":
            raise RuntimeError(event.error.message)
    return times


def _run(engine, requests) -> list[list[float]]:
    async def main():
        return await asyncio.gather(*(_timed(engine, r) for r in requests))

    return asyncio.run(main())


def measure(model_dir: Path, tp: int, rng, device: str = "cuda", tiny: bool = False) -> dict:

    import openinfer

    batches, prompt_len, decode_tokens, prefill = ((1, 4), 16, 6, 64) if tiny else (
        (1, 64), DECODE_PROMPT, DECODE_TOKENS, PREFILL_TOKENS)
    vocab = (TINY_QWEN3 if tiny else QWEN3_8B)["vocab_size"]
    start = time.perf_counter()
    engine = openinfer.create_engine(model_dir, device=device, load_format="dummy", tensor_parallel_size=tp,
                                     max_model_len=8192, max_num_seqs=max(batches), num_kv_blocks=4096,
                                     max_num_batched_tokens=PREFILL_TOKENS, enable_prefix_cache=False)
    result: dict = {"tensor_parallel_size": tp, "start_s": time.perf_counter() - start}
    result.update(decode_and_prefill(engine, rng, vocab, batches, prompt_len, decode_tokens, prefill,
                                     prefill_key="prefill_4k", warmups=4, warmup_tokens=16, prefill_repeats=3))
    return result


def decode_and_prefill(engine: Any, rng: Any, vocab: int, batches: tuple[int, ...], prompt_len: int,
                       decode_tokens: int, prefill_tokens: int, *, prefill_key: str, warmups: int,
                       warmup_tokens: int, prefill_repeats: int) -> dict[str, Any]:
    """Steady decode TPOT at each batch and a prefill's TTFT through ``engine``, which is closed
    after (with its rank workers). Keys: ``decode_bs{B}_tpot_ms`` / ``_tok_s``,
    ``{prefill_key}_ttft_ms`` / ``_tok_s``."""
    import numpy as np

    from openinfer.offline import generate_request

    result: dict[str, Any] = {}
    try:
        def prompt(n: int) -> list[int]:
            return rng.integers(2, vocab - 1, size=n).tolist()

        _run(engine, [generate_request(f"warm{i}", prompt(min(64, prompt_len)), max_tokens=warmup_tokens)
                      for i in range(warmups)])
        for batch in batches:
            requests = [generate_request(f"d{batch}-{i}", prompt(prompt_len), max_tokens=decode_tokens)
                        for i in range(batch)]
            runs = _run(engine, requests)
            # steady decode: from each request's 2nd token to its last
            tpots = [(t[-1] - t[1]) / (len(t) - 2) for t in runs if len(t) > 2]
            tpot = float(np.median(tpots)) if tpots else 0.0  # 0: tokens came in one burst (CPU smoke runs)
            result[f"decode_bs{batch}_tpot_ms"] = 1e3 * tpot
            result[f"decode_bs{batch}_tok_s"] = batch / tpot if tpot > 0 else None
        ttfts = []
        for i in range(prefill_repeats):
            begin = time.perf_counter()
            (times,) = _run(engine, [generate_request(f"p{i}", prompt(prefill_tokens), max_tokens=1)])
            ttfts.append(times[0] - begin)
        result[f"{prefill_key}_ttft_ms"] = 1e3 * float(np.median(ttfts))
        result[f"{prefill_key}_tok_s"] = prefill_tokens / float(np.median(ttfts))
    finally:
        engine.close_sync()
        close = getattr(getattr(engine, "model", None), "close", None)
        if close is not None:
            close()
    return result


def plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG", file=sys.stderr)
        return
    runs = report["runs"]
    big = "64" if "decode_bs64_tpot_ms" in runs[0] else "4"
    metrics = [("decode_bs1_tpot_ms", "decode TPOT bs=1 (ms)"), (f"decode_bs{big}_tpot_ms", f"decode TPOT bs={big} (ms)"),
               ("prefill_4k_ttft_ms", "prefill TTFT (ms)")]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, (key, title) in zip(axes, metrics, strict=True):
        sizes = [str(r["tensor_parallel_size"]) for r in runs]
        values = [r[key] for r in runs]
        ax.bar([f"TP={s}" for s in sizes], values, color=["#888", "#2a7"][: len(values)])
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.2f}", ha="center", va="bottom")
        ax.set_title(title)
    speedups = report.get("speedup_tp2_over_tp1", {})
    fig.suptitle(f"Qwen3-8B shape, dummy bf16 weights, {report['device']}  "
                 + "  ".join(f"{k}: {v:.2f}x" for k, v in speedups.items() if v is not None), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    import numpy as np

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--sizes", default="1,2")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="a tiny model, batches and prefill (smoke run)")
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes takes comma-separated integers, got {args.sizes!r}")
    from openinfer_qwen3.plugin import openinfer_model_memory

    from openinfer.parallel.layout import ParallelLayout
    from openinfer.parallel.memory_plan import plan_memory

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = TINY_QWEN3 if args.tiny else QWEN3_8B
    report: dict = {"model": "Qwen3-8B shape (36 layers, hidden 4096, 32/8 heads, vocab 151936)"
                    + (" (tiny)" if args.tiny else ""), "tiny": args.tiny,
                    "decode_prompt_tokens": DECODE_PROMPT, "decode_tokens": DECODE_TOKENS, "runs": [], "plans": {}}
    if args.device == "cuda":
        import cupy
        from cupy.cuda import nccl

        props = cupy.cuda.runtime.getDeviceProperties(0)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        report.update(device=f"{cupy.cuda.runtime.getDeviceCount()}x {name}", cupy=cupy.__version__,
                      nccl=nccl.get_version())
        _, total = cupy.cuda.runtime.memGetInfo()
    else:
        report["device"] = "CPU (numpy, thread ranks; timings are not GPU figures)"
        total = 80 * 2**30  # the plan of the full shape against an 80 GiB GPU
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        (model_dir / "config.json").write_text(json.dumps(config))
        for tp in sizes:
            plan = plan_memory(openinfer_model_memory(QWEN3_8B), ParallelLayout(tp), gpu_bytes=int(total),
                               max_model_len=8192)
            report["plans"][f"tp{tp}"] = plan.as_dict()
            run = measure(model_dir, tp, np.random.default_rng(tp), args.device, args.tiny)
            print(json.dumps(run), flush=True)
            report["runs"].append(run)
    by_tp = {r["tensor_parallel_size"]: r for r in report["runs"]}
    if 1 in by_tp and 2 in by_tp:
        one, two = by_tp[1], by_tp[2]
        report["speedup_tp2_over_tp1"] = {key[: -len("_tpot_ms")] if key.endswith("_tpot_ms") else "prefill_4k":
                                          one[key] / two[key] if two[key] > 0 else None
                                          for key in one if key.endswith(("_tpot_ms", "_ttft_ms"))}
        report["scaling_efficiency_tp2"] = {k: None if v is None else v / 2
                                            for k, v in report["speedup_tp2_over_tp1"].items()}
    report["weights_gib_per_rank"] = {k: v["ranks"][0]["weight_gib"] for k, v in report["plans"].items()}
    name = "tensor_parallel_tiny" if args.tiny else "tensor_parallel"
    (out / f"{name}.json").write_text(json.dumps(report, indent=2))
    plot(report, out / f"{name}.png")
    print(json.dumps({k: report.get(k) for k in ("speedup_tp2_over_tp1", "scaling_efficiency_tp2")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
