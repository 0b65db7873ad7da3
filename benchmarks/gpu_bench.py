"""GPU benchmark: openinfer's cuda backend on a Qwen3-4B-shaped model with random bf16 weights,
and HF transformers on the same GPU in the same run as the peer.

Measures (speed does not depend on weight values):
  ceilings   device copy bandwidth (bytes read + written) and cuBLAS bf16 GEMM rate at 8192^3;
  decode     time per step at batch 1..256, context 512, through the CUDA graph runner plus GPU
             greedy sampling and the copy of the ids to the host; against the HBM roofline
             (weight bytes + KV bytes read per step, over the measured copy bandwidth);
  prefill    time to first token of one 1k/4k/16k prompt (one step) and MFU against the GEMM rate;
  hf         the same decode/prefill through transformers (eager attention kernels: sdpa, dynamic
             cache; static cache without torch.compile);
  memory     GPU memory in use after load, host RSS.
Writes benchmarks/results/gpu_bench.json and .png (and a copy under $OUT when set).

    python benchmarks/gpu_bench.py [--quick]

``--bs1-switches`` (issue #12's bs1 goal: the served decode step no worse than 3.19 ms; it read
3.04 ms in one lease and 3.17 in a later one with no change to its graph) measures instead the
device time of the batch-1 decode step *as the server runs it*: ``openinfer serve`` on the
checkpoint (``--checkpoint``, default the random Qwen3-4B), one stream of ``--bs1-tokens`` tokens,
the step log's device time per step (``busy_ms``: graph replay + sampling between CUDA events) —
once per switch in ``BS1_VARIANTS`` (each a fresh server), the default first and again last (the
drift over the run), ``--rounds`` times. Writes bs1_switches.json and .png.

E1 s8 (H200, results/bs1_switches_s8e1_h200.json): default 3.129 / 3.127 ms (first / last), GC freeze off
3.128, bucket GEMM loads off 3.129, short-prefill graphs off 3.126, residual GEMM 3.131 — but
OPENINFER_MIXED_OVERLAP=0 2.998 and --max-num-seqs 1 2.997 (-4.2 %): both keep the server from ever
running a mixed step's decode rows on the side stream (the sweep's warm-up runs 4 streams), after which
every batch-1 step is ~130 us slower on the device. That is the 3.04 (s7 E0, before the overlap was the
default) -> 3.17 ms (s7 E2, after) of the last session.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

import numpy as np

QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)
CONTEXT = 512
BLOCK_SIZE = 16


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def gpu_time(fn, repeat: int, warmup: int = 3) -> float:
    """Median seconds of ``fn`` between CUDA events on the current stream (core's kernel-ledger timer)."""
    from openinfer.tools.ledger import gpu_seconds

    return gpu_seconds(fn, repeat, warmup)


def wall_time(fn, repeat: int, warmup: int = 2) -> float:
    """Median host seconds of ``fn`` (which must synchronize itself)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


# --- ceilings ------------------------------------------------------------------------------------

def measure_ceilings(backend) -> dict:
    import cupy

    src = cupy.random.random(2**29, dtype=cupy.float32)  # 2 GiB
    dst = cupy.empty_like(src)
    seconds = gpu_time(lambda: dst.__setitem__(Ellipsis, src), repeat=20)
    bandwidth = 2 * src.nbytes / seconds
    n = 8192
    a = backend.upload(np.random.default_rng(0).standard_normal((n, n), np.float32))
    b = backend.upload(np.random.default_rng(1).standard_normal((n, n), np.float32))
    out = cupy.empty((n, n), dtype=cupy.uint16)
    seconds = gpu_time(lambda: backend.blas.matmul_nt(a, b, out), repeat=20)
    return {"copy_bandwidth_bytes_per_s": bandwidth, "cublas_bf16_flops": 2 * n**3 / seconds}


# --- models ----------------------------------------------------------------------------------------

def build_hf(config: dict):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(Qwen3Config(**config)).to(torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.02)
    return model.eval()


def to_device_bf16(tensor):
    """A torch bf16 CUDA tensor as a CuPy uint16 array (a copy, so HF can be freed later)."""
    import cupy

    return cupy.from_dlpack(tensor.detach().contiguous().view(__import__("torch").int16)).view(cupy.uint16).copy()


def build_ours(hf, config: dict, backend):
    """The Qwen3 decoder on openinfer's backend ops, weights fused from the HF module."""
    import torch

    from openinfer import (
        AttentionSpec,
        DecoderLayer,
        DecoderStack,
        RotaryEmbedding,
        rope_parameters_from_config,
    )
    from openinfer.backend.cuda.linear import CudaLinear

    rope = RotaryEmbedding.create(config["head_dim"], rope_parameters_from_config(config), 32768,
                                  config["max_position_embeddings"])
    layers = []
    for layer in hf.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        spec = AttentionSpec(config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"], rope,
                             config["head_dim"] ** -0.5, to_device_bf16(attn.q_norm.weight),
                             to_device_bf16(attn.k_norm.weight), config["rms_norm_eps"])
        layers.append(DecoderLayer(
            input_norm=to_device_bf16(layer.input_layernorm.weight), qkv=CudaLinear(to_device_bf16(qkv), None),
            attention=spec, o_proj=CudaLinear(to_device_bf16(attn.o_proj.weight), None),
            post_attention_norm=to_device_bf16(layer.post_attention_layernorm.weight),
            gate_up=CudaLinear(to_device_bf16(gate_up), None), down=CudaLinear(to_device_bf16(mlp.down_proj.weight), None)))
    embed = to_device_bf16(hf.model.embed_tokens.weight)
    return DecoderStack(embed_tokens=embed, layers=layers, final_norm=to_device_bf16(hf.model.norm.weight),
                        lm_head=CudaLinear(embed, None), eps=config["rms_norm_eps"])


def weight_bytes(config: dict) -> int:
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + 2 * h * i + i * h
    return 2 * (layers * per_layer + config["vocab_size"] * h)


def linear_flops_per_token(config: dict) -> int:
    return weight_bytes(config)  # 2 FLOPs per bf16 weight (2 bytes) per token


# --- decode ----------------------------------------------------------------------------------------

def decode_batch(num_seqs: int, context: int, max_blocks: int):
    from openinfer.backend.base import ForwardBatch

    blocks_per_seq = -(-context // BLOCK_SIZE)
    tables = np.zeros((num_seqs, max_blocks), np.int32)
    for i in range(num_seqs):
        tables[i, :blocks_per_seq] = 1 + i * blocks_per_seq + np.arange(blocks_per_seq)
    positions = np.full(num_seqs, context - 1, np.int32)
    slots = tables[:, (context - 1) // BLOCK_SIZE] * BLOCK_SIZE + (context - 1) % BLOCK_SIZE
    return ForwardBatch(token_ids=np.random.default_rng(num_seqs).integers(0, 150000, num_seqs).astype(np.int32),
                        positions=positions, query_start=np.arange(num_seqs + 1, dtype=np.int32),
                        context_lens=np.full(num_seqs, context, np.int32), block_tables=tables,
                        slot_mapping=slots.astype(np.int32), logits_rows=np.arange(num_seqs, dtype=np.int32),
                        max_query_len=1, max_context_len=context)


def bench_decode(backend, model, config: dict, batch_sizes: list[int], ceilings: dict) -> list[dict]:
    import cupy

    from openinfer.backend.cuda.sampler import sample_device_rows
    from openinfer.graph import CudaGraphRunner
    from openinfer.sampling import SamplingState
    from openinfer.v1 import engine_pb2 as pb

    max_bs = max(batch_sizes)
    blocks_per_seq = -(-CONTEXT // BLOCK_SIZE)
    num_blocks = 1 + max_bs * blocks_per_seq
    nkv, d = config["num_key_value_heads"], config["head_dim"]
    kv = [backend.allocate_kv(num_blocks, BLOCK_SIZE, nkv, d) for _ in range(config["num_hidden_layers"])]
    for layer in kv:  # random context, not zeros
        layer.k[...] = (cupy.random.standard_normal(layer.k.shape, dtype=cupy.float32).view(cupy.uint32) >> 16).astype(cupy.uint16)
        layer.v[...] = layer.k
    runner = CudaGraphRunner(backend, lambda batch: model.forward(backend, batch, kv), max_num_seqs=max_bs,
                             max_blocks_per_seq=blocks_per_seq, buckets=batch_sizes)
    start = time.perf_counter()
    runner.capture()
    capture_s = time.perf_counter() - start
    log(f"captured {len(runner.graphs)} graphs in {capture_s:.1f} s")
    results = []
    bandwidth = ceilings["copy_bandwidth_bytes_per_s"]
    for bs in batch_sizes:
        batch = decode_batch(bs, CONTEXT, blocks_per_seq)
        states = [SamplingState.create(pb.SamplingParams(), [0], 0, i) for i in range(bs)]

        def step(batch=batch, states=states):
            logits = runner.run(batch)
            sample_device_rows(logits, states)  # greedy on the GPU + ids to the host (synchronizes)

        step_s = wall_time(step, repeat=30, warmup=3)
        replay_s = gpu_time(lambda bs=bs: runner.graphs[bs].graph.launch(), repeat=30)
        eager_s = wall_time(lambda batch=batch: (runner.eager.run(batch), backend.synchronize()), repeat=5)
        kv_bytes = bs * CONTEXT * config["num_hidden_layers"] * 2 * nkv * d * 2
        roofline_s = (weight_bytes(config) + kv_bytes) / bandwidth
        row = {"batch_size": bs, "context": CONTEXT, "step_ms": step_s * 1e3, "graph_replay_ms": replay_s * 1e3,
               "eager_step_ms": eager_s * 1e3, "roofline_ms": roofline_s * 1e3,
               "roofline_fraction": roofline_s / step_s, "tokens_per_s": bs / step_s}
        log(f"decode bs={bs}: step {row['step_ms']:.2f} ms (replay {row['graph_replay_ms']:.2f}, eager "
            f"{row['eager_step_ms']:.1f}), roofline {row['roofline_ms']:.2f} ms = {row['roofline_fraction']:.0%}")
        results.append(row)
    return results, capture_s


# --- prefill ---------------------------------------------------------------------------------------

def bench_prefill(backend, model, config: dict, lengths: list[int], ceilings: dict) -> list[dict]:

    from openinfer.backend.base import ForwardBatch

    results = []
    nkv, d = config["num_key_value_heads"], config["head_dim"]
    for n in lengths:
        blocks = -(-n // BLOCK_SIZE)
        kv = [backend.allocate_kv(blocks + 1, BLOCK_SIZE, nkv, d) for _ in range(config["num_hidden_layers"])]
        table = np.arange(1, blocks + 1, dtype=np.int32)[None, :]
        pos = np.arange(n, dtype=np.int32)
        batch = ForwardBatch(token_ids=np.random.default_rng(n).integers(0, 150000, n).astype(np.int32),
                             positions=pos, query_start=np.array([0, n], np.int32),
                             context_lens=np.array([n], np.int32), block_tables=table,
                             slot_mapping=(table[0, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).astype(np.int32),
                             logits_rows=np.array([n - 1], np.int32), max_query_len=n, max_context_len=n)

        def run(batch=batch, kv=kv):
            logits = model.forward(backend, backend.prepare_batch(batch), kv)
            logits[0].argmax().get()

        seconds = wall_time(run, repeat=3 if n <= 4096 else 2, warmup=1)
        attention_flops = 4 * config["num_hidden_layers"] * config["num_attention_heads"] * d * n * n / 2
        flops = linear_flops_per_token(config) * n + attention_flops
        row = {"tokens": n, "ttft_ms": seconds * 1e3, "flops": flops,
               "mfu": flops / seconds / ceilings["cublas_bf16_flops"]}
        log(f"prefill {n}: {row['ttft_ms']:.1f} ms, MFU {row['mfu']:.0%}")
        results.append(row)
    return results


# --- HF transformers peer --------------------------------------------------------------------------

def bench_hf(hf, batch_sizes: list[int], lengths: list[int]) -> dict:
    import torch

    out = {"decode": [], "prefill": []}
    vocab = hf.config.vocab_size
    for cache in ("dynamic", "static"):
        for bs in batch_sizes:
            prompt = torch.randint(0, vocab, (bs, CONTEXT - 1), device="cuda")
            kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=0)
            if cache == "static":
                kwargs.update(cache_implementation="static", disable_compile=True)

            def gen(n, prompt=prompt, kwargs=kwargs):
                with torch.no_grad():
                    hf.generate(prompt, max_new_tokens=n, **kwargs)
                torch.cuda.synchronize()

            try:
                one = wall_time(lambda gen=gen: gen(1), repeat=2, warmup=1)
                many = wall_time(lambda gen=gen: gen(33), repeat=2, warmup=1)
            except Exception as exc:  # noqa: BLE001 - record and go on
                log(f"HF {cache} bs={bs} failed: {exc!r}")
                continue
            tpot = (many - one) / 32
            out["decode"].append({"cache": cache, "batch_size": bs, "context": CONTEXT, "tpot_ms": tpot * 1e3,
                                  "tokens_per_s": bs / tpot})
            log(f"HF {cache} bs={bs}: {tpot * 1e3:.2f} ms/token")
    for n in lengths:
        ids = torch.randint(0, vocab, (1, n), device="cuda")

        def prefill(ids=ids):
            with torch.no_grad():
                hf(ids, logits_to_keep=1)
            torch.cuda.synchronize()

        try:
            seconds = wall_time(prefill, repeat=2, warmup=1)
        except Exception as exc:  # noqa: BLE001
            log(f"HF prefill {n} failed: {exc!r}")
            continue
        out["prefill"].append({"tokens": n, "ttft_ms": seconds * 1e3})
        log(f"HF prefill {n}: {seconds * 1e3:.1f} ms")
    return out


# --- report ----------------------------------------------------------------------------------------

def environment(backend) -> dict:
    import cupy

    env = {"gpu": backend.device_name, "num_sms": backend.num_sms, "cupy": cupy.__version__,
           "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(), "cuda_driver": cupy.cuda.runtime.driverGetVersion(),
           "python": platform.python_version(), "numpy": np.__version__}
    try:
        import torch
        import transformers

        env.update(torch=torch.__version__, transformers=transformers.__version__)
    except ImportError:
        pass
    return env


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    decode = report["decode"]
    bs = [r["batch_size"] for r in decode]
    left.plot(bs, [r["step_ms"] for r in decode], "o-", label="openinfer (graphs + GPU sampling)")
    left.plot(bs, [r["roofline_ms"] for r in decode], "k--", label="HBM roofline (weights + KV)")
    for cache in ("dynamic", "static"):
        rows = [r for r in report.get("hf", {}).get("decode", []) if r["cache"] == cache]
        if rows:
            left.plot([r["batch_size"] for r in rows], [r["tpot_ms"] for r in rows], "s:", label=f"HF transformers ({cache} cache)")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("batch size (context 512)")
    left.set_ylabel("ms per decode step")
    left.set_title(f"Qwen3-4B-shaped decode on {report['environment']['gpu']}")
    left.legend(fontsize=8)
    prefill = report["prefill"]
    x = np.arange(len(prefill))
    right.bar(x, [r["mfu"] * 100 for r in prefill], color="tab:blue")
    right.set_xticks(x, [f"{r['tokens']}" for r in prefill])
    right.set_xlabel("prompt tokens")
    right.set_ylabel("MFU % of measured cuBLAS bf16 rate")
    right.set_title("prefill (one step)")
    for i, r in enumerate(prefill):
        right.text(i, r["mfu"] * 100 + 1, f"{r['ttft_ms']:.0f} ms", ha="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# (name, environment, extra `openinfer serve` flags): the switches that could touch the batch-1
# decode step, each alone
BS1_VARIANTS = (
    ("default", {}, ""),
    ("gc_freeze_off", {"OPENINFER_GC_FREEZE": "0"}, ""),  # the start-up heap not frozen for the GC
    ("mixed_overlap_off", {"OPENINFER_MIXED_OVERLAP": "0"}, ""),  # no side stream (made at a mixed step)
    ("bucket_gemm_loads_off", {"OPENINFER_BUCKET_GEMM_LOADS": "0"}, ""),  # no GEMMs after capture
    # capture order / pool: without the short-prefill graphs the batch-1 decode graph is the last
    # captured; with --max-num-seqs 1 it is the only decode graph (its pool holds nothing else)
    ("prefill_graphs_off", {"OPENINFER_PREFILL_GRAPHS": "0"}, ""),
    ("only_bucket_1", {}, "--max-num-seqs 1"),
    # opt-in: o_proj / down add into the residual (a batch-1 row keeps its GEMVs: expected unchanged)
    ("residual_gemm_on", {"OPENINFER_RESIDUAL_GEMM": "1"}, ""),
)


def bs1_switches(args: argparse.Namespace) -> dict:
    """The served batch-1 decode step's device time under each of ``BS1_VARIANTS``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_concurrency import gpu_name, run_openinfer, warm_page_cache

    checkpoint = Path(args.checkpoint)
    if args.stub:
        from openinfer.demo import ensure_demo_model
        from openinfer.engine_core.stub import write_stub_model

        checkpoint = write_stub_model(Path("/tmp/openinfer-stub-bs1"), ensure_demo_model(), step_ms=3.0,
                                      max_model_len=4096)
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    warm_page_cache(checkpoint)
    chosen = [v for v in BS1_VARIANTS if v[0] == "default" or not args.bs1_variants or v[0] in args.bs1_variants]
    order = chosen * args.rounds + [BS1_VARIANTS[0]]  # the default again last: drift
    report: dict = {"device": gpu_name(), "checkpoint": str(checkpoint), "tokens": args.bs1_tokens, "runs": []}
    for name, env, serve_args in order:
        options = argparse.Namespace(max_model_len=4096, stub=args.stub, serve_args=serve_args, start_timeout=300.0,
                                     input_len=args.bs1_prompt, output_len=args.bs1_tokens, clients="lean",
                                     client_procs=1, ttft_contexts=[], ttft_repeats=1, tag=f"bs1_{name}")
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        try:
            run = run_openinfer(options, checkpoint, 1, [1], vocab)
        except Exception as exc:  # noqa: BLE001 - record and go on to the next switch
            log(f"bs1 {name}: failed: {exc!r}")
            report["runs"].append({"variant": name, "error": repr(exc)})
            continue
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        row = run["sweep"][0]
        decode = row.get("engine_steps", {}).get("decode", {})
        entry = {"variant": name, "env": env, "serve_args": serve_args, "tpot_ms_p50": row["tpot_ms"]["p50"],
                 "decode_steps": decode.get("num_steps"), "graph_steps": decode.get("graph_steps"),
                 "device_ms_p50": decode.get("busy_ms_p50"), "device_ms_mean": decode.get("busy_ms_mean"),
                 "host_ms_mean": decode.get("host_ms_mean"),
                 "gap_ms_p50": row.get("engine_steps", {}).get("gap_ms_p50"),
                 "launch_period_ms_p50": row.get("full_batch_decode", {}).get("period_ms_p50")}
        log(f"bs1 {name}: device {entry['device_ms_p50']} ms p50 over {entry['decode_steps']} decode steps, "
            f"TPOT {entry['tpot_ms_p50']:.3f} ms")
        report["runs"].append(entry)
    defaults = [r["device_ms_p50"] for r in report["runs"] if r["variant"] == "default" and r.get("device_ms_p50")]
    if defaults:
        reference = float(np.median(defaults))
        report["default_device_ms_p50"] = reference
        for entry in report["runs"]:
            if entry.get("device_ms_p50"):
                entry["over_default"] = entry["device_ms_p50"] / reference
    return report


def plot_bs1(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in report["runs"] if r.get("device_ms_p50")]
    fig, axis = plt.subplots(figsize=(10, 4.5))
    axis.bar(range(len(runs)), [r["device_ms_p50"] for r in runs], color="tab:blue", label="decode step, device (p50)")
    axis.plot(range(len(runs)), [r["tpot_ms_p50"] for r in runs], "ko", label="TPOT p50 (client)")
    axis.axhline(3.19, color="red", linestyle="--", label="goal 3.19 ms")
    axis.set_xticks(range(len(runs)), [r["variant"] for r in runs], rotation=30, ha="right", fontsize=8)
    axis.set_ylim(min(r["device_ms_p50"] for r in runs) * 0.95, None)
    axis.set_ylabel("ms")
    axis.set_title(f"served batch-1 decode step per switch — {report['device']}")
    axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer sizes (a smoke run)")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF transformers peer")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--bs1-switches", action="store_true",
                        help="only the served batch-1 decode step per switch (see the module docstring)")
    parser.add_argument("--checkpoint", default="/tmp/qwen3-4b-random", help="for --bs1-switches")
    parser.add_argument("--bs1-tokens", type=int, default=256, help="tokens of the one stream (--bs1-switches)")
    parser.add_argument("--bs1-prompt", type=int, default=512, help="its prompt's tokens (--bs1-switches)")
    parser.add_argument("--rounds", type=int, default=1, help="passes over the switches (--bs1-switches)")
    parser.add_argument("--bs1-variants", default="",
                        help="comma list of BS1_VARIANTS names to run (the default always runs; empty: all)")
    parser.add_argument("--stub", action="store_true", help="--bs1-switches on the CPU: the stub engine (3 ms steps)")
    args = parser.parse_args()
    if args.bs1_switches:
        names = {name for name, _, _ in BS1_VARIANTS}
        args.bs1_variants = [v for v in args.bs1_variants.split(",") if v.strip()]
        if args.rounds < 1 or args.bs1_tokens < 8 or args.bs1_prompt < 1 or set(args.bs1_variants) - names:
            parser.error(f"--rounds >= 1, --bs1-tokens >= 8, --bs1-prompt >= 1, --bs1-variants from {sorted(names)}")
        report = bs1_switches(args)
        out_dirs = [Path(args.out)] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else [])
        for out in out_dirs:
            out.mkdir(parents=True, exist_ok=True)
            (out / "bs1_switches.json").write_text(json.dumps(report, indent=2))
            try:
                plot_bs1(report, out / "bs1_switches.png")
            except (ModuleNotFoundError, ValueError) as error:
                log(f"no bs1_switches.png: {error!r}")
        print("\n variant                 device p50 ms  × default  TPOT p50 ms")
        for r in report["runs"]:
            if r.get("device_ms_p50"):
                print(f" {r['variant']:22s} {r['device_ms_p50']:13.3f} {r.get('over_default', float('nan')):10.3f} "
                      f"{r['tpot_ms_p50']:12.3f}")
            else:
                print(f" {r['variant']:22s} {r.get('error', 'no device times')}")
        return
    import cupy

    from openinfer.backend.cuda import CudaBackend

    t0 = time.perf_counter()
    backend = CudaBackend()
    report: dict = {"environment": environment(backend), "model": {"shape": "Qwen3-4B", **QWEN3_4B,
                                                                   "weight_bytes": weight_bytes(QWEN3_4B)}}
    log(f"{report['environment']}")
    report["ceilings"] = measure_ceilings(backend)
    log(f"ceilings: {report['ceilings']}")
    hf = build_hf(QWEN3_4B)
    model = build_ours(hf, QWEN3_4B, backend)
    cupy.cuda.get_current_stream().synchronize()
    free, total = cupy.cuda.runtime.memGetInfo()
    report["memory"] = {"gpu_used_after_load_bytes": total - free, "note": "HF model resident too",
                        "host_max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    batch_sizes = [1, 8, 64] if args.quick else [1, 2, 4, 8, 16, 32, 64, 128, 256]
    lengths = [1024] if args.quick else [1024, 4096, 16384]
    report["decode"], report["graph_capture_s"] = bench_decode(backend, model, QWEN3_4B, batch_sizes, report["ceilings"])
    cupy.get_default_memory_pool().free_all_blocks()
    report["prefill"] = bench_prefill(backend, model, QWEN3_4B, lengths, report["ceilings"])
    if not args.no_hf:
        report["hf"] = bench_hf(hf, [1, 8, 64] if args.quick else [1, 8, 32, 64], lengths)
        by_bs = {r["batch_size"]: r for r in report["decode"]}
        report["ratios"] = {
            f"{r['cache']}_bs{r['batch_size']}_speedup": r["tpot_ms"] / by_bs[r["batch_size"]]["step_ms"]
            for r in report["hf"]["decode"] if r["batch_size"] in by_bs}
    report["total_seconds"] = time.perf_counter() - t0
    out_dirs = [Path(args.out)] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else [])
    for out in out_dirs:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_bench.json").write_text(json.dumps(report, indent=2))
        plot(report, out / "gpu_bench.png")
    print("\n batch  step_ms  roofline_ms  roofline%  tok/s")
    for r in report["decode"]:
        print(f" {r['batch_size']:5d} {r['step_ms']:8.2f} {r['roofline_ms']:11.2f} {r['roofline_fraction']:9.0%} "
              f"{r['tokens_per_s']:8.0f}")
    for r in report["prefill"]:
        print(f" prefill {r['tokens']:6d}: {r['ttft_ms']:8.1f} ms  MFU {r['mfu']:.0%}")
    print(json.dumps(report.get("ratios", {}), indent=1))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
