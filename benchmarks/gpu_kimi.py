"""Kimi-K2 / DeepSeek-V3 GPU benchmarks (issue 13), JSON + PNG into benchmarks/results/.

``layer``: one Kimi-K2-shaped decoder layer (hidden 7168, MLA with 64 heads over a paged latent
cache, 384 INT4 experts top-8 + 1 shared expert; random weights, speed does not depend on the
values) timed alone with CUDA events at batch 1/64/256, against its HBM roofline: the bytes a
step must read (attention weights, the router, the shared expert, every expert some token routes
to, the batch's latent cache) over the measured device-to-device copy bandwidth.

    python benchmarks/gpu_kimi.py layer [--context 1024] [--iters 20]

``moonlight``: a Moonlight-16B-A3B-shaped random bf16 checkpoint (27 layers, hidden 2048, 16
heads, kv_lora 512, qk 128+64, v 128, one dense layer of 11264, then 64 experts of 1408 top-6 + 2
shared, routed scaling 2.446, vocab 163840) served by ``openinfer serve`` and, with ``--vllm``,
by vLLM 0.26.0 (``../shared/tools/vllm-peer.sh``), driven by the same client
(``benchmarks/serve.py``): decode TPOT with 1/16/64 concurrent streams and the output throughput
of 256 streams (1k in / 128 out).

    python benchmarks/gpu_kimi.py moonlight [--checkpoint /tmp/moonlight-random] [--vllm]
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

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

KIMI_LAYER = {"hidden": 7168, "heads": 64, "q_lora": 1536, "kv_lora": 512, "nope": 128, "rope": 64, "v": 128,
              "experts": 384, "top_k": 8, "inter": 2048, "group": 32}
MOONLIGHT = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 163840,
    "hidden_size": 2048, "intermediate_size": 11264, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64,
    "num_experts_per_tok": 6, "n_shared_experts": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "routed_scaling_factor": 2.446, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "norm_topk_prob": True, "max_position_embeddings": 8192, "rope_theta": 50000.0, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "bos_token_id": 163584, "eos_token_id": 163585, "torch_dtype": "bfloat16",
}


def device_name() -> str:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown GPU"


def copy_bandwidth() -> float:
    """Measured device-to-device copy bandwidth in bytes/s (read + write of a 2 GiB buffer)."""
    import cupy

    src = cupy.ones(2**30, dtype=cupy.uint16)
    dst = cupy.empty_like(src)
    dst[...] = src
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(10):
        dst[...] = src
    stop.record()
    stop.synchronize()
    seconds = cupy.cuda.get_elapsed_time(start, stop) / 1e3 / 10
    return 2 * src.nbytes / seconds


# --- one Kimi-K2 layer ---------------------------------------------------------------------------

def build_layer(backend, rng):
    """Random device weights of one Kimi-K2 MoE layer, INT4 routed experts."""
    import cupy

    from openinfer.backend.cuda.moe import DeviceMoE, ExpertLinear
    from openinfer.moe import RouterSpec

    c = KIMI_LAYER
    h, heads = c["hidden"], c["heads"]

    def bf16(*shape, scale=0.02):
        return backend.weight((scale * rng.standard_normal(shape)).astype(np.float32))

    def int4(experts, n, k):
        words = cupy.random.randint(-2**31, 2**31 - 1, size=(experts, n, k // 8), dtype=cupy.int64).astype(cupy.int32)
        scales = backend.weight(np.full((experts, n, k // c["group"]), 0.01, np.float32))
        return ExpertLinear("int4", words, scales, n, k, group=c["group"])

    latent = c["kv_lora"] + c["rope"]
    attention = {
        "qkv_a": backend.linear_weight(0.02 * rng.standard_normal((c["q_lora"] + latent, h)).astype(np.float32)),
        "q_a_norm": bf16(c["q_lora"], scale=1.0), "kv_a_norm": bf16(c["kv_lora"], scale=1.0),
        "q_b": backend.linear_weight(0.02 * rng.standard_normal((heads * (c["nope"] + c["rope"]), c["q_lora"]))
                                     .astype(np.float32)),
        "w_uk": bf16(heads, c["nope"], c["kv_lora"]), "w_uv": bf16(heads, c["v"], c["kv_lora"]),
        "o_proj": backend.linear_weight(0.02 * rng.standard_normal((h, heads * c["v"])).astype(np.float32)),
    }
    router = RouterSpec(c["experts"], c["top_k"], "sigmoid", routed_scaling_factor=2.827)
    moe = DeviceMoE(router, bf16(c["experts"], h), cupy.zeros(c["experts"], cupy.float32),
                    int4(c["experts"], 2 * c["inter"], h), int4(c["experts"], h, c["inter"]))
    shared = (backend.linear_weight(0.02 * rng.standard_normal((2 * c["inter"], h)).astype(np.float32)),
              backend.linear_weight(0.02 * rng.standard_normal((h, c["inter"])).astype(np.float32)))
    return attention, moe, shared


def layer_bytes(attention, moe, shared, active_experts: int, batch: int, context: int) -> int:
    """HBM bytes one decode step of the layer must read at least."""
    c = KIMI_LAYER
    weights = sum(w.weight.nbytes for w in (attention["qkv_a"], attention["q_b"], attention["o_proj"], *shared))
    weights += attention["w_uk"].nbytes + attention["w_uv"].nbytes + moe.gate.nbytes
    per_expert = (moe.gate_up.data[0].nbytes + moe.gate_up.scale[0].nbytes + moe.down.data[0].nbytes
                  + moe.down.scale[0].nbytes)
    kv = batch * context * (c["kv_lora"] + c["rope"]) * 2
    return weights + active_experts * per_expert + kv


def run_layer(args) -> dict:
    import cupy

    from openinfer.backend.base import ForwardBatch
    from openinfer.backend.cuda import CudaBackend
    from openinfer.backend.cuda import mla as cuda_mla
    from openinfer.backend.cuda import moe as cuda_moe
    from openinfer.mla import MLASpec
    from openinfer.rope import RopeParameters, RotaryEmbedding

    backend = CudaBackend()
    rng = np.random.default_rng(0)
    attention, moe, shared = build_layer(backend, rng)
    c = KIMI_LAYER
    spec = MLASpec(c["heads"], c["nope"], c["rope"], c["v"], c["kv_lora"], (c["nope"] + c["rope"]) ** -0.5)
    rope = RotaryEmbedding.create(c["rope"], RopeParameters(50000.0), args.context + 8)
    cos, sin = cupy.asarray(rope.cos), cupy.asarray(rope.sin)
    bandwidth = copy_bandwidth()
    points = []
    for batch in (1, 64, 256):
        block_size = 64
        blocks_per_seq = -(-(args.context + 1) // block_size)
        cache = cupy.zeros((batch * blocks_per_seq + 1, block_size, c["kv_lora"] + c["rope"]), cupy.uint16)
        tables = (1 + np.arange(batch * blocks_per_seq, dtype=np.int32)).reshape(batch, blocks_per_seq)
        positions = np.full(batch, args.context, np.int32)
        slots = tables[:, args.context // block_size] * block_size + args.context % block_size
        host = ForwardBatch(token_ids=np.zeros(batch, np.int32), positions=positions,
                            query_start=np.arange(batch + 1, dtype=np.int32),
                            context_lens=np.full(batch, args.context + 1, np.int32), block_tables=tables,
                            slot_mapping=slots.astype(np.int32), logits_rows=np.arange(batch, dtype=np.int32),
                            max_query_len=1, max_context_len=args.context + 1)
        device_batch = backend.prepare_batch(host)
        x = backend.upload(rng.standard_normal((batch, c["hidden"])).astype(np.float32))

        def step(x=x, cache=cache, device_batch=device_batch):
            qkv_a = backend.linear(x, attention["qkv_a"])
            q = backend.linear(backend.rms_norm(cupy.ascontiguousarray(qkv_a[:, :c["q_lora"]]), attention["q_a_norm"],
                                                1e-6), attention["q_b"])
            attn = cuda_mla.mla_forward(backend.blas, q, qkv_a[:, c["q_lora"]:], cache, attention["w_uk"],
                                        attention["w_uv"], attention["kv_a_norm"], spec, device_batch, cos, sin, 1e-6)
            h = backend.linear(attn, attention["o_proj"])
            shared_out = backend.linear(backend.silu_mul(backend.linear(h, shared[0])), shared[1])
            return cuda_moe.moe_forward(backend, h, moe, shared_out)

        for _ in range(3):
            step()
        ids, _ = cuda_moe.route(x, moe.gate, moe.router, moe.correction_bias)
        active = int(cupy.unique(ids).size)
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(args.iters):
            step()
        stop.record()
        stop.synchronize()
        seconds = cupy.cuda.get_elapsed_time(start, stop) / 1e3 / args.iters
        needed = layer_bytes(attention, moe, shared, active, batch, args.context)
        roofline = needed / bandwidth
        points.append({"batch": batch, "step_ms": 1e3 * seconds, "roofline_ms": 1e3 * roofline,
                       "fraction_of_roofline": roofline / seconds, "active_experts": active, "bytes": needed})
        print(json.dumps(points[-1]))
    return {"benchmark": "kimi_k2_layer", "device": device_name(), "copy_bandwidth_gbs": bandwidth / 1e9,
            "context": args.context, "layer": KIMI_LAYER, "points": points}


def plot_layer(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = report["points"]
    x = np.arange(len(points))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(x - 0.2, [p["step_ms"] for p in points], 0.4, label="openinfer (measured)")
    ax.bar(x + 0.2, [p["roofline_ms"] for p in points], 0.4, label="HBM roofline")
    for i, p in enumerate(points):
        ax.text(i - 0.2, p["step_ms"], f"{100 * p['fraction_of_roofline']:.0f}%", ha="center", va="bottom")
    ax.set(xticks=x, xticklabels=[f"batch {p['batch']}" for p in points], ylabel="ms per layer step",
           title=f"one Kimi-K2 layer (MLA + 384 INT4 experts top-8), context {report['context']} — {report['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# --- Moonlight-shaped serving, side by side with vLLM --------------------------------------------

def write_moonlight(path: Path) -> None:
    """Random bf16 weights in HF DeepSeek-V3 names (shard per layer) + a word-level tokenizer."""
    from gpu_serving import write_tokenizer

    from openinfer.weights import write_safetensors

    if (path / "config.json").exists():
        return
    path.mkdir(parents=True, exist_ok=True)
    c = MOONLIGHT
    rng = np.random.default_rng(0)

    def w(*shape, scale=0.02):
        bits = (scale * rng.standard_normal(shape, dtype=np.float32)).view(np.uint32) >> 16
        return bits.astype(np.uint16)

    def save(tensors: dict, name: str, weight_map: dict) -> None:
        write_safetensors(path / name, {k: ("BF16", v) if v.dtype == np.uint16 else v for k, v in tensors.items()})
        weight_map.update({k: name for k in tensors})

    weight_map: dict[str, str] = {}
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    save({"model.embed_tokens.weight": w(c["vocab_size"], hidden), "model.norm.weight": w(hidden, scale=1.0),
          "lm_head.weight": w(c["vocab_size"], hidden)}, "model-top.safetensors", weight_map)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        t = {f"{p}.input_layernorm.weight": w(hidden, scale=1.0), f"{p}.post_attention_layernorm.weight": w(hidden, scale=1.0),
             f"{p}.self_attn.q_proj.weight": w(heads * qk, hidden),
             f"{p}.self_attn.kv_a_proj_with_mqa.weight": w(c["kv_lora_rank"] + c["qk_rope_head_dim"], hidden),
             f"{p}.self_attn.kv_a_layernorm.weight": w(c["kv_lora_rank"], scale=1.0),
             f"{p}.self_attn.kv_b_proj.weight": w(heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"]),
             f"{p}.self_attn.o_proj.weight": w(hidden, heads * c["v_head_dim"])}
        if i < c["first_k_dense_replace"]:
            inter = c["intermediate_size"]
            t.update({f"{p}.mlp.gate_proj.weight": w(inter, hidden), f"{p}.mlp.up_proj.weight": w(inter, hidden),
                      f"{p}.mlp.down_proj.weight": w(hidden, inter)})
        else:
            inter = c["moe_intermediate_size"]
            t[f"{p}.mlp.gate.weight"] = w(c["n_routed_experts"], hidden)
            t[f"{p}.mlp.gate.e_score_correction_bias"] = np.zeros(c["n_routed_experts"], np.float32)
            for e in range(c["n_routed_experts"]):
                t.update({f"{p}.mlp.experts.{e}.gate_proj.weight": w(inter, hidden),
                          f"{p}.mlp.experts.{e}.up_proj.weight": w(inter, hidden),
                          f"{p}.mlp.experts.{e}.down_proj.weight": w(hidden, inter)})
            shared = inter * c["n_shared_experts"]
            t.update({f"{p}.mlp.shared_experts.gate_proj.weight": w(shared, hidden),
                      f"{p}.mlp.shared_experts.up_proj.weight": w(shared, hidden),
                      f"{p}.mlp.shared_experts.down_proj.weight": w(hidden, shared)})
        save(t, f"model-layer{i:02d}.safetensors", weight_map)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(c, indent=2))
    write_tokenizer(path, c["vocab_size"])


def serve_points(url: str, model: str, vocab: int) -> dict:
    from serve import sweep_rate

    rng = np.random.default_rng(0)
    points = {}
    for streams in (1, 16, 64, 256):
        prompts = [rng.integers(100, vocab - 100, size=1024).tolist() for _ in range(streams)]
        points[str(streams)] = asyncio.run(sweep_rate(url, model, float("inf"), prompts, 128, 0))
        print(streams, json.dumps(points[str(streams)]))
    return points


def run_server(command: list[str], url: str, env: dict | None = None):
    from serve import wait_ready

    process = subprocess.Popen(command, env=env)
    try:
        model = wait_ready(url, timeout=1800)
    except Exception:
        process.kill()
        raise
    return process, model


def run_moonlight(args) -> dict:
    checkpoint = Path(args.checkpoint)
    write_moonlight(checkpoint)
    vocab = MOONLIGHT["vocab_size"]
    report = {"benchmark": "moonlight_serving", "device": device_name(), "input_len": 1024, "output_len": 128,
              "checkpoint": "Moonlight-16B-A3B-shaped, random bf16", "engines": {}}
    url = "http://127.0.0.1:8125"
    process, model = run_server([sys.executable, "-m", "openinfer.cli", "serve", "--model-path", str(checkpoint),
                                 "--port", "8125", "--grpc-port", "0", "--max-model-len", "4096"], url)
    try:
        report["engines"]["openinfer"] = serve_points(url, model, vocab)
    finally:
        process.terminate()
        process.wait(60)
    if args.vllm:
        env = {**os.environ, "PYTHONPATH": "/tmp/vsite:/tmp/site"}
        url = "http://127.0.0.1:8126"
        process, model = run_server([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                                     str(checkpoint), "--port", "8126", "--max-model-len", "4096",
                                     "--gpu-memory-utilization", "0.9", "--trust-remote-code"], url, env)
        try:
            report["engines"]["vllm"] = serve_points(url, model, vocab)
        finally:
            process.terminate()
            process.wait(60)
        ours, peer = report["engines"]["openinfer"], report["engines"]["vllm"]
        report["ratios"] = {
            **{f"tpot_bs{s}": peer[s]["tpot_ms"]["p50"] / ours[s]["tpot_ms"]["p50"] for s in ("1", "16", "64")},
            "throughput_256": ours["256"]["output_throughput"] / peer["256"]["output_throughput"]}
    return report


def plot_moonlight(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, points in report["engines"].items():
        streams = ["1", "16", "64"]
        left.plot(streams, [points[s]["tpot_ms"]["p50"] for s in streams], "o-", label=name)
        right.bar(name, points["256"]["output_throughput"])
    left.set(xlabel="concurrent streams", ylabel="TPOT p50 (ms)", title="decode TPOT")
    left.legend()
    right.set(ylabel="output tokens/s", title="256 streams, 1k in / 128 out")
    fig.suptitle(f"Moonlight-16B-A3B shape, random bf16 — {report['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    layer = sub.add_parser("layer")
    layer.add_argument("--context", type=int, default=1024)
    layer.add_argument("--iters", type=int, default=20)
    moon = sub.add_parser("moonlight")
    moon.add_argument("--checkpoint", default="/tmp/moonlight-random")
    moon.add_argument("--vllm", action="store_true", help="also serve it with vLLM (installed by vllm-peer.sh)")
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    if args.command == "layer":
        report, name, plot = run_layer(args), "kimi_layer", plot_layer
    else:
        report, name, plot = run_moonlight(args), "moonlight_serving", plot_moonlight
    report["time"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=2))
    plot(report, RESULTS / f"{name}.png")
    if os.environ.get("OUT"):
        for suffix in (".json", ".png"):
            shutil.copy(RESULTS / f"{name}{suffix}", Path(os.environ["OUT"]) / f"{name}{suffix}")


if __name__ == "__main__":
    main()
