"""Expert parallel through the whole engine (ranks as processes on GPUs, NCCL, CUDA graphs; thread
ranks on the CPU), dummy weights (``--load-format dummy``), two shapes:

``moonlight``: the Moonlight-16B-A3B-shaped MoE of the Kimi-K2 issue (27 layers, 64 experts top-6,
MLA) at EP=1 and EP=2 — decode TPOT at batch 1 and 64, TTFT of a 4096-token prefill, speedup.

``dsv4-flash``: the whole DeepSeek-V4-Flash shape (43 layers, 256 FP4 experts) served with EP=2
on two H200s — decode TPOT at batch 1 and 32, TTFT of a 4096-token prefill — with the per-GPU
memory plan (weights, reserve, KV budget and tokens per rank) printed and stored. The goal:
<= 20 ms/token on two GPUs (PegaInfer needed 8 GPUs at about 27-30 ms/token).

    NCCL_NVLS_ENABLE=0 python benchmarks/gpu_expert_parallel.py moonlight [--sizes 1,2] [--out DIR]
    NCCL_NVLS_ENABLE=0 python benchmarks/gpu_expert_parallel.py dsv4-flash [--sizes 2]
    python benchmarks/gpu_expert_parallel.py moonlight --tiny --device cpu   # CPU smoke run (CI)

Writes ``expert_parallel_<shape>.json`` (+ ``.png`` when matplotlib is present) to ``--out``
(default benchmarks/results). A size the engine refuses (a layout, a plugin without a path for
it) is recorded with its error and the other sizes still run; the exit status is 1 then.
``--tiny`` shrinks the model, the batches and the prefill so the same code runs in seconds; the
memory plan of the full shape is computed either way (on the CPU against ``--plan-gpu-gib``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off in this process and its ranks
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from gpu_kimi import MOONLIGHT  # noqa: E402  (the released Moonlight-16B-A3B shape)
from gpu_tensor_parallel import decode_and_prefill  # noqa: E402
from openinfer_deepseek_v4.config import flash_config  # noqa: E402

H200_GIB = 140.0  # what an H200 reports as total memory (141 GB)

TINY_MOONLIGHT = {**MOONLIGHT, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                  "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                  "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
                  "bos_token_id": 0, "eos_token_id": 1}

DSV4_FLASH = flash_config()  # the released DeepSeek-V4-Flash config.json (the plugin's one copy)
TINY_DSV4 = {**DSV4_FLASH, "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 8,
             "head_dim": 32, "qk_rope_head_dim": 16, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 32,
             "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "num_hash_layers": 1,
             "sliding_window": 8, "index_n_heads": 4, "index_head_dim": 32, "index_topk": 8, "hc_sinkhorn_iters": 4,
             "compress_ratios": [0, 4, 128, 0], "max_position_embeddings": 4096,
             "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 1024,
                              "beta_fast": 32, "beta_slow": 1}}


class Shape:
    """What one shape's run measures."""

    def __init__(self, name: str, config: dict, tiny: dict, description: str, sizes: str, batches: tuple[int, ...]):
        self.name, self.config, self.tiny, self.description = name, config, tiny, description
        self.default_sizes, self.batches = sizes, batches


SHAPES = {
    "moonlight": Shape("moonlight", MOONLIGHT, TINY_MOONLIGHT,
                       "Moonlight-16B-A3B shape (27 layers, hidden 2048, 64 experts top-6, MLA), dummy bf16",
                       "1,2", (1, 64)),
    "dsv4-flash": Shape("dsv4-flash", DSV4_FLASH, TINY_DSV4,
                        "DeepSeek-V4-Flash shape (43 layers, hidden 4096, 256 FP4 experts top-6), dummy weights",
                        "2", (1, 32)),
}
GOAL_DSV4_TPOT_MS = 20.0


def measure(model_dir: Path, config: dict, ep: int, device: str, batches: tuple[int, ...], prompt_len: int,
            decode_tokens: int, prefill_tokens: int, seed: int) -> dict:
    import numpy as np

    import openinfer

    rng = np.random.default_rng(seed)
    vocab = int(config["vocab_size"])
    max_model_len = max(2 * prefill_tokens, prompt_len + decode_tokens + 64)
    options: dict[str, Any] = {"max_model_len": max_model_len, "max_num_seqs": max(batches),
                               "max_num_batched_tokens": max(prefill_tokens, 256), "enable_prefix_cache": False}
    if device == "cpu":
        options["num_kv_blocks"] = 4 * max(batches) * (-(-max_model_len // 16))
    result: dict[str, Any] = {"expert_parallel_size": ep}
    start = time.perf_counter()
    engine = openinfer.create_engine(model_dir, device=device, load_format="dummy", expert_parallel_size=ep,
                                     **options)
    result["start_s"] = time.perf_counter() - start
    result.update(decode_and_prefill(engine, rng, vocab, batches, prompt_len, decode_tokens, prefill_tokens,
                                     prefill_key=f"prefill_{prefill_tokens}", warmups=2, warmup_tokens=4,
                                     prefill_repeats=2))
    return result


def memory_plans(config: dict, sizes: list[int], gpu_bytes: int, max_model_len: int) -> dict:
    """Each size's per-GPU plan (weights, reserve, KV) from the plugin's ``openinfer_model_memory``,
    with whether it fits and, when not, the refusal the engine would print."""
    from openinfer.errors import ParallelConfigError
    from openinfer.parallel import ParallelLayout
    from openinfer.parallel.memory_plan import MemoryPlanError, plan_memory
    from openinfer.plugins import discover_plugins

    registry = discover_plugins()
    memory = registry.model_memory(registry.select(config, "<config>"), config)
    plans = {}
    for ep in sizes:
        try:
            plan = plan_memory(memory, ParallelLayout(expert_parallel_size=ep), gpu_bytes=gpu_bytes,
                               max_model_len=max_model_len)
        except ParallelConfigError as exc:
            plans[f"ep{ep}"] = {"error": str(exc)}
            continue
        entry = plan.as_dict()
        print(plan.render(), flush=True)
        try:
            plan.check()
            entry["fits"] = True
        except MemoryPlanError as exc:
            entry["fits"], entry["refusal"] = False, str(exc)
        entry["sequences_at_max_model_len"] = min(r["kv_tokens"] for r in entry["ranks"]) // max_model_len
        plans[f"ep{ep}"] = entry
    return plans


def plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG", file=sys.stderr)
        return
    runs = [r for r in report["runs"] if "error" not in r]
    if not runs:
        return
    metrics = [key for key in runs[0] if key.endswith(("_tpot_ms", "_ttft_ms"))]
    fig, axes = plt.subplots(1, len(metrics) + 1, figsize=(4 * (len(metrics) + 1), 3.8))
    for ax, key in zip(axes, metrics, strict=False):
        labels = [f"EP={r['expert_parallel_size']}" for r in runs]
        values = [r[key] for r in runs]
        ax.bar(labels, values, color=["#888", "#2a7", "#27a", "#a72"][: len(values)])
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.2f}", ha="center", va="bottom")
        ax.set_title(key.replace("_", " ").replace(" ms", " (ms)"))
    ax = axes[-1]  # per-GPU memory plan of the largest size
    plan = report["memory_plan"].get(f"ep{max(r['expert_parallel_size'] for r in runs)}", {})
    if "ranks" in plan:
        rank = plan["ranks"][0]
        parts = {**{f"weights: {k}": v for k, v in rank["weights_by_split_gib"].items() if v},
                 "graphs + activations": rank["reserve_gib"], "KV cache": rank["kv_gib"]}
        bottom = 0.0
        for label, value in parts.items():
            ax.bar(["rank 0"], [value], bottom=bottom, label=f"{label} {value:.1f}")
            bottom += value
        ax.set_ylabel("GiB")
        ax.set_title(f"per-GPU plan (of {rank['gpu_gib']:.0f} GiB)")
        ax.legend(fontsize=7)
    fig.suptitle(f"{report['model']} — {report['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def device_description(device: str) -> tuple[str, int]:
    """The device in words and its memory in bytes (for the plan)."""
    if device == "cpu":
        return "CPU (numpy, thread ranks; timings are not GPU figures)", 0
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    _, total = cupy.cuda.runtime.memGetInfo()
    return f"{cupy.cuda.runtime.getDeviceCount()}x {name}", int(total)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--sizes", default=None, help="expert-parallel sizes to run, comma-separated")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="a tiny model, batches and prefill (smoke run)")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--plan-gpu-gib", type=float, default=H200_GIB,
                        help="GPU memory the plan assumes when no GPU is at hand (default: an H200)")
    parser.add_argument("--plan-max-model-len", type=int, default=131072,
                        help="context the memory plan counts sequences at")
    args = parser.parse_args(argv)
    shape = SHAPES[args.shape]
    try:
        sizes = [int(s) for s in (args.sizes or shape.default_sizes).split(",")]
    except ValueError:
        parser.error(f"--sizes takes comma-separated integers, got {args.sizes!r}")
    if any(s < 1 for s in sizes):
        parser.error("--sizes must be at least 1")
    if args.tiny:
        config, batches, prompt_len, decode_tokens, prefill_tokens = shape.tiny, (1, 4), 16, 6, 64
    else:
        config, batches, prompt_len, decode_tokens, prefill_tokens = shape.config, shape.batches, 128, 128, 4096
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device, gpu_bytes = device_description(args.device)
    gpu_bytes = gpu_bytes or int(args.plan_gpu_gib * 2**30)
    report: dict[str, Any] = {
        "benchmark": f"expert_parallel_{args.shape}", "model": shape.description + (" (tiny)" if args.tiny else ""),
        "device": device, "tiny": args.tiny, "decode_prompt_tokens": prompt_len, "decode_tokens": decode_tokens,
        "prefill_tokens": prefill_tokens, "batches": list(batches), "runs": [],
        # the plan of the full shape, whatever ran: what each GPU will hold
        "memory_plan": memory_plans(shape.config, sizes, gpu_bytes, args.plan_max_model_len),
        "memory_plan_gpu_gib": gpu_bytes / 2**30, "memory_plan_max_model_len": args.plan_max_model_len}
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        (model_dir / "config.json").write_text(json.dumps(config))
        for ep in sizes:
            try:
                run = measure(model_dir, config, ep, args.device, batches, prompt_len, decode_tokens, prefill_tokens,
                              seed=ep)
            except Exception as exc:  # noqa: BLE001 - recorded; the other sizes still run
                run, failed = {"expert_parallel_size": ep, "error": f"{type(exc).__name__}: {exc}"}, True
            print(json.dumps(run), flush=True)
            report["runs"].append(run)
    by_ep = {r["expert_parallel_size"]: r for r in report["runs"] if "error" not in r}
    if 1 in by_ep and 2 in by_ep:
        one, two = by_ep[1], by_ep[2]
        report["speedup_ep2_over_ep1"] = {k[: -len("_ms")]: one[k] / two[k] if two[k] > 0 else None for k in one
                                          if k.endswith(("_tpot_ms", "_ttft_ms")) and k in two}
    if args.shape == "dsv4-flash" and 2 in by_ep and not args.tiny:
        report["goal_tpot_ms"] = GOAL_DSV4_TPOT_MS
        report["goal_met_bs1"] = by_ep[2]["decode_bs1_tpot_ms"] <= GOAL_DSV4_TPOT_MS
    name = f"expert_parallel_{args.shape.replace('-', '_')}" + ("_tiny" if args.tiny else "")
    (out / f"{name}.json").write_text(json.dumps(report, indent=2))
    plot(report, out / f"{name}.png")
    print(json.dumps({k: report.get(k) for k in ("speedup_ep2_over_ep1", "goal_met_bs1")}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
