"""The ``openinfer`` command: ``generate``, ``serve``, ``plan`` and ``plugins``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import uuid
from pathlib import Path

from openinfer.cli_types import INT32_MAX, UINT64_MAX, float_range, int_range, non_empty, token_ids
from openinfer.errors import OpenInferError


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", default=None, type=non_empty("--model-path"),
                        help="model directory (config.json + *.safetensors); default: the demo model")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--max-model-len", type=int_range(2, INT32_MAX), default=None,
                        help="context length, >= 2 (default: the model's)")
    parser.add_argument("--num-kv-blocks", type=int_range(1, INT32_MAX), default=None,
                        help="KV pool size in blocks, >= 1 (default: sized from memory)")
    parser.add_argument("--trace-dir", default=None, type=non_empty("--trace-dir"),
                        help="write the request's Chrome-trace JSON (engine spans) into this directory")
    _add_parallel_arguments(parser)


def _add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    _add_parallel_sizes(parser)
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                        help="dummy: random weights at the real shapes, from config.json alone")


def _add_parallel_sizes(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tensor-parallel-size", type=int_range(1, 1024), default=1,
                        help="ranks splitting every layer by heads / rows, one GPU each (default 1)")
    parser.add_argument("--expert-parallel-size", type=int_range(1, 1024), default=1,
                        help="ranks splitting the MoE experts, one GPU each (default 1)")
    parser.add_argument("--enable-attention-data-parallel", dest="attention_data_parallel", action="store_true",
                        help="with --expert-parallel-size >= 2: each rank attends for its own sequences and "
                             "caches only their KV (not with tensor parallel)")


def _resolve_model_path(model_path: str | None) -> Path:
    if model_path:
        return Path(model_path)
    from openinfer.demo import ensure_demo_model  # converts the GGUF on first use

    return ensure_demo_model()


def cmd_generate(args: argparse.Namespace) -> int:
    from openinfer import create_engine
    from openinfer.v1 import engine_pb2 as pb

    model_path = _resolve_model_path(args.model_path)
    tokenizer = None
    tokenizer_file = model_path / "tokenizer.json"
    if tokenizer_file.exists():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    if args.prompt is not None:
        if tokenizer is None:
            raise OpenInferError(f"--prompt needs {tokenizer_file}; pass --prompt-token-ids instead")
        prompt_ids = tokenizer.encode(args.prompt, add_special_tokens=False).ids
    else:
        prompt_ids = args.prompt_token_ids
    engine = create_engine(model_path, device=args.device, max_model_len=args.max_model_len,
                           num_kv_blocks=args.num_kv_blocks, tensor_parallel_size=args.tensor_parallel_size,
                           expert_parallel_size=args.expert_parallel_size, load_format=args.load_format,
                           attention_data_parallel=args.attention_data_parallel,
                           trace_dir=args.trace_dir)
    sampling = pb.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.seed is not None:
        sampling.seed = args.seed
    request = pb.GenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=prompt_ids, sampling=sampling,
                                 stop=pb.StopConditions(max_tokens=args.max_tokens))

    async def run() -> tuple[list[int], str]:
        ids: list[int] = []
        reason = "length"
        try:
            async for event in engine.generate(request):
                kind = event.WhichOneof("event")
                if kind == "tokens":
                    ids.extend(event.tokens.ids)
                    if not args.json and tokenizer is not None:
                        print(tokenizer.decode(list(event.tokens.ids)), end="", flush=True)
                elif kind == "finished":
                    reason = "stop" if event.finished.reason == pb.FINISH_REASON_STOP else "length"
                elif kind == "error":
                    raise OpenInferError(event.error.message)
        finally:
            await engine.close()
        return ids, reason

    import asyncio

    ids, reason = asyncio.run(run())
    text = tokenizer.decode(ids) if tokenizer is not None else None
    if args.json:
        print(json.dumps({"token_ids": ids, "text": text, "finish_reason": reason}))
    elif tokenizer is None:
        print(",".join(map(str, ids)))
    else:
        print()
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    from openinfer.plugins import discover_plugins

    registry = discover_plugins()
    if not registry.plugins:
        print("no model plugins installed; e.g. pip install ./plugins/openinfer-qwen3")
        return 0
    rows = [(p.distribution, p.version, p.name, ", ".join(p.claims)) for p in registry.plugins.values()]
    if args.json:
        print(json.dumps([dict(zip(("distribution", "version", "entry_point", "claims"), r, strict=True))
                          for r in rows]))
        return 0
    widths = [max(len(str(r[i])) for r in [("DISTRIBUTION", "VERSION", "ENTRY POINT", "CLAIMS"), *rows])
              for i in range(4)]
    for row in [("DISTRIBUTION", "VERSION", "ENTRY POINT", "CLAIMS"), *rows]:
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Print what each rank will hold, on the CPU, from config.json alone; exit 2 if it cannot fit."""
    from openinfer.parallel.layout import ParallelLayout, check_devices
    from openinfer.parallel.memory_plan import GIB, plan_memory
    from openinfer.plugins import discover_plugins, read_model_config

    config_path = Path(args.config)
    model_dir = config_path if config_path.is_dir() else config_path.parent
    if config_path.is_dir() or config_path.name == "config.json":
        config = read_model_config(model_dir)
    else:
        try:
            config = json.loads(config_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise OpenInferError(f"--config {config_path}: cannot read a JSON config ({exc})") from exc
    layout = ParallelLayout(args.tensor_parallel_size, args.expert_parallel_size, args.attention_data_parallel)
    if args.num_gpus is not None:
        check_devices(layout, args.num_gpus)
    registry = discover_plugins()
    plugin = registry.select(config, str(config_path))
    memory = registry.model_memory(plugin, config)
    if memory is None:
        raise OpenInferError(f"plugin {plugin!r} does not describe its memory (no openinfer_model_memory hook)")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    max_len = args.max_model_len or int(text.get("max_position_embeddings", 4096))
    plan = plan_memory(memory, layout, gpu_bytes=int(args.gpu_memory_gib * GIB),
                       gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=max_len,
                       max_num_seqs=args.max_num_seqs)
    print(json.dumps(plan.as_dict(), indent=2) if args.json else plan.render())
    plan.check()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="openinfer", description="LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    generate = sub.add_parser("generate", help="generate tokens for one prompt")
    _add_engine_arguments(generate)
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", default=None, help="prompt text (needs tokenizer.json)")
    prompt.add_argument("--prompt-token-ids", type=token_ids, default=None,
                        help="comma-separated token ids, each >= 0")
    generate.add_argument("--max-tokens", type=int_range(1, INT32_MAX), default=16, help=">= 1 (default 16)")
    generate.add_argument("--temperature", type=float_range(0), default=0.0, help=">= 0; 0 is greedy (default)")
    generate.add_argument("--top-k", type=int_range(-1, INT32_MAX), default=0, help="0 or -1: off (default)")
    generate.add_argument("--top-p", type=float_range(0, 1, low_inclusive=False), default=1.0,
                          help="in (0, 1] (default 1)")
    generate.add_argument("--seed", type=int_range(0, UINT64_MAX), default=None, help=">= 0")
    generate.add_argument("--json", action="store_true", help="print one JSON object")
    generate.set_defaults(handler=cmd_generate)

    plan = sub.add_parser("plan", help="print the per-GPU memory plan for a config (runs on the CPU)")
    plan.add_argument("--config", required=True, type=non_empty("--config"),
                      help="config.json, or a model directory holding one")
    _add_parallel_sizes(plan)
    plan.add_argument("--gpu-memory-gib", type=float_range(0, low_inclusive=False), default=140.4,
                      help="memory of one GPU in GiB, > 0 (default: H200's 140.4)")
    plan.add_argument("--gpu-memory-utilization", type=float_range(0, 1, low_inclusive=False), default=0.90,
                      help="fraction of GPU memory to use, in (0, 1] (default 0.9)")
    plan.add_argument("--max-model-len", type=int_range(2, INT32_MAX), default=None,
                      help="context length, >= 2 (default: the config's)")
    plan.add_argument("--max-num-seqs", type=int_range(1, INT32_MAX), default=256, help=">= 1 (default 256)")
    plan.add_argument("--num-gpus", type=int_range(1, 1024), default=None,
                      help="refuse layouts needing more GPUs than this, >= 1")
    plan.add_argument("--json", action="store_true")
    plan.set_defaults(handler=cmd_plan)

    plugins = sub.add_parser("plugins", help="list installed model plugins")
    plugins.add_argument("--json", action="store_true")
    plugins.set_defaults(handler=cmd_plugins)

    try:
        from openinfer.frontend import serve
    except ImportError:
        serve = None
    if serve is not None and hasattr(serve, "add_arguments"):
        serve_parser = sub.add_parser("serve", help="serve a model over HTTP (OpenAI API) and gRPC")
        serve.add_arguments(serve_parser)
        serve_parser.set_defaults(handler=serve.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "WARNING").upper()
                        if isinstance(getattr(args, "log_level", None), str) else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.handler(args) or 0)
    except OpenInferError as exc:
        print(f"openinfer: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
