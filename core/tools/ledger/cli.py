"""``python -m openinfer.tools.ledger``: the engine built for the model, its steps measured over
the grid, the report written (see the package docstring)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from openinfer.tools.ledger.batches import BLOCK_SIZE, StepLayout, decode_batch, prefill_batch
from openinfer.tools.ledger.recording import OpRecorder, op_cost, op_key, shape_of
from openinfer.tools.ledger.report import write_partial, write_report
from openinfer.tools.ledger.timing import HostTimer, Timer, ceilings

PRESETS: dict[str, dict[str, Any]] = {
    # Qwen3-4B's shape (benchmarks/gpu_bench.py)
    "qwen3-4b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=2560,
                     intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     tie_word_embeddings=True),
    # transformers' default Qwen3_5TextConfig (a 9B-class hybrid: 3 Gated DeltaNet layers per full
    # attention); the rest of its config.json is filled from transformers when it is written
    "qwen3.5-default": dict(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text"),
    # Moonlight-16B-A3B's published shape (the DeepSeek-V3 architecture of Kimi-K2: MLA, 64 routed
    # experts top-6 + 2 shared, a dense first layer); needs openinfer-kimi-k2
    "moonlight": dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=163840,
                      hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408, num_hidden_layers=27,
                      num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
                      qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
                      num_experts_per_tok=6, n_shared_experts=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                      moe_layer_freq=1, routed_scaling_factor=2.446, scoring_func="sigmoid", topk_method="noaux_tc",
                      norm_topk_prob=True, max_position_embeddings=8192, rope_theta=50000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, bos_token_id=163584, eos_token_id=163585, torch_dtype="bfloat16",
                      hidden_act="silu", rope_scaling=None, attention_bias=False, num_nextn_predict_layers=0),
}


def write_preset_config(preset: str, path: Path) -> Path:
    """``path/config.json`` of ``preset`` (served with ``load_format="dummy"``). A preset that
    names only its architecture takes the rest from transformers' default config of that class
    (a test/bench dependency, needed only here)."""
    config = dict(PRESETS[preset])
    if config["model_type"] == "qwen3_5_text" and len(config) == 2:
        import transformers

        config = {**transformers.Qwen3_5TextConfig().to_dict(), **config}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


# cuda attention's rows: the q/k norm + RoPE + KV write, then whichever routing ``attend`` takes
# (a mixed step's is one row: its decode-kernel and prefill-kernel launches together)
CUDA_ATTENTION_CALLS = ("write_qkv", "decode_attention", "short_query_attention", "mixed_attention",
                        "prefill_attention")


class Ledger:
    """Measures steps of one engine's model: records a forward's op calls, times them, builds the
    per-op rows (kernels, shape, bytes, FLOPs, % roofline) and the measured whole step."""

    def __init__(self, engine: Any, timer: Timer | HostTimer, peak: dict[str, float], repeats: int):
        self.engine = engine
        self.model = engine.model
        self.backend = self.model.backend
        self.timer = timer
        self.peak = peak
        self.repeats = repeats
        self.layout = StepLayout.of(engine)
        cuda = self.backend.name == "cuda"
        expand = None
        if cuda:  # attention as its two launches: q/k norm + RoPE + KV write, then the kernel
            from openinfer.backend.cuda import attention

            expand = {"attention": (attention, CUDA_ATTENTION_CALLS)}
        self.recorder = OpRecorder({"backend": self.backend}, self.model, kernel_names=cuda, expand=expand)
        self.graphs = getattr(engine.runner, "graphs", {})

    def decode(self, num_seqs: int, context: int) -> Any:
        if self.layout.with_state and num_seqs >= self.engine.kv_plan.num_state_slots:
            raise ValueError(f"batch {num_seqs} needs more state slots than the engine has "
                             f"({self.engine.kv_plan.num_state_slots}, slot 0 the null slot)")
        return decode_batch(num_seqs, context, self.layout)

    def prefill(self, tokens: int) -> Any:
        return prefill_batch(tokens, self.layout)

    def _forward(self, host: Any) -> Any:
        device = self.backend.prepare_batch(host)
        return lambda: self.model.forward(device, self.engine.kv_cache)

    def measure(self, phase: str, host: Any) -> dict[str, Any]:
        forward = self._forward(host)
        forward()  # warm-up: compiles kernels
        calls = self.recorder.record(forward)
        timed = self.timer.ops(calls, self.repeats, forward)
        device_s, host_s = timed["device_s"], timed["host_s"]
        rows: dict[str, dict[str, Any]] = {}
        for call, dev, hst in zip(calls, device_s, host_s, strict=True):
            key = op_key(call)
            moved, flops = op_cost(call, host)
            row = rows.setdefault(key, {"op": key, "kernels": [], "shape": " ".join(
                s for s in (shape_of(a) for a in call.args) if s), "calls": 0, "time_s": 0.0, "host_s": 0.0,
                "bytes": 0.0, "flops": 0.0})
            for kernel_name in call.kernels:
                if kernel_name not in row["kernels"]:
                    row["kernels"].append(kernel_name)
            row["calls"] += 1
            row["time_s"] += dev
            row["host_s"] += hst
            row["bytes"] += moved
            row["flops"] += flops
        for row in rows.values():
            if not row["calls"] or row["op"].startswith("(host"):
                row.update(roofline_s=0.0, roofline_pct=None, bound="host")
                continue
            roofline = max(row["bytes"] / self.peak["copy_bytes_per_s"], row["flops"] / self.peak["bf16_flops_per_s"])
            row["roofline_s"] = roofline
            row["roofline_pct"] = 100.0 * roofline / row["time_s"] if row["time_s"] > 0 else None
            row["bound"] = "memory" if row["bytes"] / self.peak["copy_bytes_per_s"] >= \
                row["flops"] / self.peak["bf16_flops_per_s"] else "compute"
        # the model's Python between ops: host time only (it matters on the eager path)
        between = max(0.0, timed["forward_host_s"] - sum(host_s))
        rows["(host: model code between ops)"] = {
            "op": "(host: model code between ops)", "kernels": [], "shape": "", "calls": 1, "time_s": 0.0,
            "host_s": between, "bytes": 0.0, "flops": 0.0}
        measured = self.measure_step(host, forward)
        result = {"phase": phase, "batch": host.num_seqs, "context": int(host.max_context_len),
                  "tokens": int(host.num_tokens), "ops": sorted(rows.values(), key=lambda r: -r["time_s"]),
                  "sum_device_s": float(sum(device_s)), "sum_host_s": float(sum(host_s)),
                  "forward_host_s": timed["forward_host_s"], "event_cost_s": timed["event_cost_s"], **measured}
        return result

    def measure_step(self, host: Any, forward: Any) -> dict[str, Any]:
        bucket = self.engine.runner.bucket_for(host) if self.graphs else None
        if bucket is not None:
            captured = self.graphs[bucket]
            captured.static.fill(host)
            return {"measured_s": self.timer.gpu(captured.graph.launch, max(10, self.repeats)),
                    "measured_how": f"CUDA graph replay (bucket {bucket}), events"}
        repeats = max(3, self.repeats // 2)
        how = "eager forward, host clock to stream sync" if self.backend.name == "cuda" else "forward, host clock"
        return {"measured_s": self.timer.wall(forward, repeats), "measured_how": how}


def _grid(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m openinfer.tools.ledger", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model-path", help="checkpoint directory")
    source.add_argument("--random", choices=sorted(PRESETS),
                        help="this shape with random weights (its config.json only, load_format dummy)")
    source.add_argument("--from-json", help="no GPU: re-derive the step-time model and tables from a ledger JSON")
    parser.add_argument("--checkpoint-dir", default="/tmp/openinfer-ledger", help="where --random writes")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: the NumPy backend, timed on the host clock")
    parser.add_argument("--load-format", choices=("auto", "dummy"), default=None,
                        help="dummy: random weights at the checkpoint's shapes (default with --random)")
    parser.add_argument("--batches", type=_grid, default=[1, 4, 16, 64, 128, 256])
    parser.add_argument("--contexts", type=_grid, default=[128, 384, 1024],
                        help="decode contexts (batch 256 x 1024 tokens of Qwen3-4B KV: 39 GB; fits an 80 GB GPU)")
    parser.add_argument("--prefill", type=_grid, default=[512, 2048, 8192], help="prefill lengths (one sequence)")
    parser.add_argument("--check", default="1:512,64:512,256:512,48:1536",
                        help="decode batch:context points to predict and measure")
    parser.add_argument("--check-prefill", type=_grid, default=[4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--name", help="model name in the report")
    parser.add_argument("--out", help="ledger JSON (default with --from-json: that file)")
    parser.add_argument("--markdown", help="ledger table (default: --out with .md)")
    args = parser.parse_args(argv)
    if args.from_json:
        try:
            report = json.loads(Path(args.from_json).read_text())
        except (OSError, ValueError) as exc:
            parser.error(f"cannot read the ledger {args.from_json!r}: {exc}")
        report.setdefault("name", report.pop("model", None) if isinstance(report.get("model"), str) else None)
        write_report(report, Path(args.out or args.from_json), args.markdown)
        return 0
    if not args.out:
        parser.error("--out is required")
    try:
        checks = [tuple(int(v) for v in point.split(":")) for point in args.check.split(",") if point]
        if any(len(c) != 2 or min(c) < 1 for c in checks):
            raise ValueError
    except ValueError:
        parser.error(f"--check takes batch:context pairs, got {args.check!r}")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.device == "cuda":
        try:
            import cupy  # noqa: F401
        except ImportError:
            print("the ledger times kernels on an NVIDIA GPU: CuPy is not installed (--device cpu: the NumPy "
                  "backend)", file=sys.stderr)
            return 2

    from openinfer import create_engine

    path = Path(args.model_path) if args.model_path else Path(args.checkpoint_dir) / args.random
    if args.random:
        write_preset_config(args.random, path)
    elif not (path / "config.json").is_file():
        parser.error(f"no config.json in --model-path {args.model_path!r}")
    load_format = args.load_format or ("dummy" if args.random else "auto")
    max_batch = max([*args.batches, *(b for b, _ in checks)])
    max_context = max([*args.contexts, *(c for _, c in checks), *args.prefill, *args.check_prefill])
    # the KV pool holds the largest step measured: every sequence its own blocks
    decode_blocks = max(b * -(-c // BLOCK_SIZE) for b, c in
                        [*((b, c) for b in args.batches for c in args.contexts), *checks])
    num_blocks = max(decode_blocks, -(-max_context // BLOCK_SIZE)) + 2
    engine = create_engine(str(path), device=args.device, max_num_seqs=max_batch,
                           max_model_len=max_context + BLOCK_SIZE, num_kv_blocks=num_blocks,
                           enable_prefix_cache=False, load_format=load_format)
    partial = Path(args.out).with_suffix(".partial.json")
    try:
        timer = Timer() if args.device == "cuda" else HostTimer()
        peak = ceilings(timer)
        print(f"ceilings: {timer.peak_names[0]} {peak['copy_bytes_per_s'] / 1e9:.0f} GB/s, {timer.peak_names[1]} "
              f"{peak['bf16_flops_per_s'] / 1e12:.1f} TFLOP/s", flush=True)
        ledger = Ledger(engine, timer, peak, args.repeats)
        backend = engine.model.backend
        report = {"name": args.name or path.name, "model_path": str(path),
                  "device": getattr(backend, "device_name", f"CPU ({backend.name} backend)"),
                  "command": "python -m openinfer.tools.ledger " + " ".join(sys.argv[1:] if argv is None else argv),
                  "ceilings": peak, "ceiling_names": list(timer.peak_names), "cuda_graphs": bool(ledger.graphs),
                  "checks": [], "entries": []}
        grid = {(b, c) for b in args.batches for c in args.contexts}
        for batch in args.batches:
            for context in args.contexts:
                entry = ledger.measure("decode", ledger.decode(batch, context))
                report["entries"].append(entry)
                print(f"decode b={batch} c={context}: ops {entry['sum_device_s'] * 1e3:.3f} ms, "
                      f"measured {entry['measured_s'] * 1e3:.3f} ms", flush=True)
                write_partial(report, partial)
        for tokens in args.prefill:
            entry = ledger.measure("prefill", ledger.prefill(tokens))
            report["entries"].append(entry)
            print(f"prefill {tokens}: ops {entry['sum_device_s'] * 1e3:.2f} ms, measured {entry['measured_s'] * 1e3:.2f} ms",
                  flush=True)
            write_partial(report, partial)
        for batch, context in checks:
            entry = ledger.measure("decode", ledger.decode(batch, context))
            report["checks"].append({"phase": "decode", "batch": batch, "context": context,
                                     "measured_s": entry["measured_s"], "measured_how": entry["measured_how"],
                                     "on_grid": (batch, context) in grid})
            write_partial(report, partial)
        for tokens in args.check_prefill:
            entry = ledger.measure("prefill", ledger.prefill(tokens))
            report["checks"].append({"phase": "prefill", "batch": 1, "context": tokens,
                                     "measured_s": entry["measured_s"], "measured_how": entry["measured_how"],
                                     "on_grid": tokens in args.prefill})
    finally:
        engine.close_sync()
    write_report(report, Path(args.out), args.markdown)
    partial.unlink(missing_ok=True)
    return 0


