"""Qwen3.5 on one GPU (issue 17): decode TPOT with CUDA graphs over the engine-owned state slots
vs eager steps, and what the hybrid prefix cache (KV blocks + recurrent-state snapshots) buys
for a warm multi-turn chat.

A Qwen3.5-4B-shaped text checkpoint with random bf16 weights (24 Gated DeltaNet + 8 gated
attention layers; speed does not depend on the values) is written once, then through the
default engine (``openinfer.create_engine``, greedy, ignore_eos):

- decode TPOT at 1 / 16 / 64 concurrent streams (512-token prompts, 64 new tokens): the mean
  gap between a request's token events after its first, graphs on and off;
- a second chat turn: a 4,000-token history (prompt + 32 generated tokens) plus a 50-token new
  turn — TTFT when the history is served from the prefix cache (its state restored from the
  snapshot the first turn's decode left at a block boundary) vs recomputed (another cache salt).

    python benchmarks/gpu_qwen35.py [--checkpoint /tmp/qwen35-4b-random] [--quick]
Writes benchmarks/results/gpu_qwen35.json and .png (copies under $OUT when set).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

# Qwen3.5-4B text shape: 32 layers (every 4th full attention), hidden 2560, GDN 16 key / 32 value heads
QWEN35_4B = {
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": 248320,
    "hidden_size": 2560, "intermediate_size": 9216, "num_hidden_layers": 32, "num_attention_heads": 16,
    "num_key_value_heads": 4, "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 8, "full_attention_interval": 4,
    "attn_output_gate": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    "eos_token_id": 248044,
}


def write_checkpoint(path: Path) -> float:
    import torch
    from transformers import Qwen3_5ForCausalLM
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    start = time.perf_counter()
    fields = {k: v for k, v in QWEN35_4B.items() if k not in ("architectures", "model_type")}
    with torch.device("cuda"):
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**fields)).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    saved = json.loads((path / "config.json").read_text())
    saved.update(QWEN35_4B)
    (path / "config.json").write_text(json.dumps(saved))
    del model
    torch.cuda.empty_cache()
    return time.perf_counter() - start


async def timed(engine, request) -> tuple[float, list[float], int, list[int]]:
    """(TTFT s, token event times, cached tokens, token ids) of one request."""
    start = time.perf_counter()
    times: list[float] = []
    ids: list[int] = []
    cached = 0
    async for event in engine.generate(request):
        kind = event.WhichOneof("event")
        if kind == "tokens":
            times.extend([time.perf_counter()] * len(event.tokens.ids))
            ids.extend(event.tokens.ids)
        elif kind == "scheduled":
            cached = event.scheduled.cached_tokens
        elif kind == "error":
            raise RuntimeError(event.error.message)
    return times[0] - start, times, cached, ids


def tpot(engine, rng, streams: int, prompt_len: int, new_tokens: int, tag: str) -> float:
    from openinfer.offline import generate_request as make_request

    requests = [make_request(f"{tag}-{streams}-{i}", rng.integers(100, 200000, size=prompt_len).tolist(),
                             max_tokens=new_tokens) for i in range(streams)]

    async def main():
        return await asyncio.gather(*(timed(engine, r) for r in requests))

    results = asyncio.run(main())
    gaps = [(t[-1] - t[0]) / (len(t) - 1) for _, t, _, _ in results]
    return 1000 * statistics.mean(gaps)


def multi_turn(engine, rng, history: int, new_turn: int) -> dict:
    from openinfer.offline import generate_request as make_request

    prompt = rng.integers(100, 200000, size=history - 32).tolist()
    # the second turn repeats the history token for token (prompt + what turn 1 generated)
    outcome = asyncio.run(timed(engine, make_request("turn1", prompt, max_tokens=32)))[3]
    turn = prompt + outcome + rng.integers(100, 200000, size=new_turn).tolist()
    warm = asyncio.run(timed(engine, make_request("turn2", turn, max_tokens=8)))
    cold = asyncio.run(timed(engine, make_request("turn2-cold", turn, max_tokens=8, cache_salt="cold")))
    return {"history_tokens": len(prompt) + len(outcome), "new_turn_tokens": new_turn,
            "warm_ttft_ms": 1000 * warm[0], "warm_cached_tokens": warm[2],
            "cold_ttft_ms": 1000 * cold[0], "cold_cached_tokens": cold[2]}


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    streams = sorted({int(k) for k in results["tpot_ms"]["graphs"]})
    for mode in ("graphs", "eager"):
        left.plot(streams, [results["tpot_ms"][mode].get(str(s)) for s in streams], marker="o", label=mode)
    left.set_xlabel("concurrent streams")
    left.set_ylabel("TPOT ms")
    left.set_title("Qwen3.5-4B shape: decode TPOT")
    left.legend()
    turn = results["multi_turn"]
    right.bar(["cold (recomputed)", "warm (prefix cache)"], [turn["cold_ttft_ms"], turn["warm_ttft_ms"]])
    right.set_ylabel("TTFT ms")
    right.set_title(f"second turn: {turn['history_tokens']} history + {turn['new_turn_tokens']} new")
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="/tmp/qwen35-4b-random")
    parser.add_argument("--quick", action="store_true", help="fewer streams and tokens")
    args = parser.parse_args()
    import numpy as np

    import openinfer

    path = Path(args.checkpoint)
    results: dict = {"shape": "Qwen3.5-4B text (random bf16)", "tpot_ms": {"graphs": {}, "eager": {}}}
    if not (path / "config.json").exists():
        results["checkpoint_write_s"] = write_checkpoint(path)
    streams = (1, 16) if args.quick else (1, 16, 64)
    new_tokens = 32 if args.quick else 64
    for mode in ("graphs", "eager"):
        engine = openinfer.create_engine(path, device="cuda", max_model_len=8192, max_num_seqs=64,
                                         cuda_graph=mode == "graphs")
        try:
            rng = np.random.default_rng(0)
            tpot(engine, rng, 2, 64, 8, f"warm-{mode}")
            for n in streams:
                results["tpot_ms"][mode][str(n)] = tpot(engine, rng, n, 512, new_tokens, mode)
                print(f"{mode} TPOT at {n} streams: {results['tpot_ms'][mode][str(n)]:.2f} ms", flush=True)
            if mode == "graphs":
                results["graph_capture_s"] = getattr(engine.runner, "capture_seconds", None)
                results["kv_plan"] = {"num_blocks": engine.kv_plan.num_blocks,
                                      "num_state_slots": engine.kv_plan.num_state_slots,
                                      "num_snapshot_slots": engine.kv_plan.num_snapshot_slots,
                                      "state_bytes_per_slot": engine.kv_groups.bytes_per_slot}
                results["multi_turn"] = multi_turn(engine, rng, 4000, 50)
                print(f"multi-turn: {results['multi_turn']}", flush=True)
        finally:
            engine.close_sync()
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / "gpu_qwen35.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "gpu_qwen35.png")
    if os.environ.get("OUT"):
        for name in ("gpu_qwen35.json", "gpu_qwen35.png"):
            if (out / name).exists():
                shutil.copy(out / name, os.environ["OUT"])
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
