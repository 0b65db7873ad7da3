"""``openinfer serve``: the HTTP server (and, for a local engine, the gRPC server) of one model.

``add_arguments`` declares the flags, ``run`` serves until SIGINT/SIGTERM and returns the exit
code. Engine flags are forwarded untouched as options to ``openinfer.create_engine`` (their
names are the fields of ``openinfer.options.EngineOptions``); a flag left out keeps the
engine's default. Shutdown order: stop accepting (HTTP and gRPC), let in-flight requests finish
for ``--shutdown-timeout`` seconds (then they are cancelled and aborted), close the engine, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn

from openinfer.engine import EngineHandle
from openinfer.errors import OpenInferError
from openinfer.tokenizer import Tokenizer

logger = logging.getLogger("openinfer.serve")

# flags forwarded to openinfer.create_engine; each dest is an EngineOptions field
ENGINE_OPTION_FLAGS = ("device", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks",
                       "gpu_memory_utilization", "enable_prefix_cache", "cuda_graph", "async_scheduling",
                       "max_queue", "seed", "tensor_parallel_size", "expert_parallel_size", "load_format")


def _bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument("--model-path", help="model directory (config.json, *.safetensors, tokenizer.json); "
                                            "default: the demo model")
    model.add_argument("--engine", help="serve a remote engine instead of a local model: grpc://HOST:PORT")
    model.add_argument("--engine-timeout", type=float, default=60.0,
                       help="seconds to wait for the --engine to answer at start-up (default 60)")
    model.add_argument("--tokenizer", help="tokenizer directory (default: the model's own; with --engine, "
                                           "the tokenizer path the remote engine reports)")
    model.add_argument("--served-model-name", help="model name clients send (default: the directory name)")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    server.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    server.add_argument("--grpc-port", type=int, default=50051,
                        help="gRPC port: openinfer.v1.Engine, grpc.health.v1 and the SGLang scheduler service "
                             "for the smg router (default 50051; 0 disables; not served with --engine)")
    server.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (HTTP) / the same gRPC metadata")
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    server.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024,
                        help="largest accepted HTTP request body (default 16 MiB; larger → 413)")
    server.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests get to finish on SIGINT/SIGTERM (default 30)")
    engine = parser.add_argument_group("engine (forwarded to openinfer.create_engine)")
    engine.add_argument("--device", choices=["auto", "cuda", "cpu"], help="default auto")
    engine.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    engine.add_argument("--max-num-seqs", type=int, help="most requests in one batch")
    engine.add_argument("--max-num-batched-tokens", type=int, help="token budget of one step")
    engine.add_argument("--num-kv-blocks", type=int, help="KV pool size in blocks (default: sized from memory)")
    engine.add_argument("--gpu-memory-utilization", type=float, help="fraction of GPU memory to use")
    engine.add_argument("--no-prefix-cache", dest="enable_prefix_cache", action="store_const", const=False,
                        help="disable prefix caching")
    engine.add_argument("--cuda-graph", type=_bool, metavar="true|false", help="capture decode CUDA graphs")
    engine.add_argument("--async-scheduling", type=_bool, metavar="true|false",
                        help="launch step N+1 before reading step N back (default: on for cuda)")
    engine.add_argument("--max-queue", type=int, help="bounded waiting queue; a full queue answers 503")
    engine.add_argument("--seed", type=int, help="engine seed for unseeded sampling")
    engine.add_argument("--tensor-parallel-size", type=int, help="ranks splitting every layer (one GPU each)")
    engine.add_argument("--expert-parallel-size", type=int, help="ranks splitting the MoE experts (one GPU each)")
    engine.add_argument("--load-format", choices=["auto", "dummy"],
                        help="dummy: random weights at the real shapes, no checkpoint needed")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags the user gave (unset ones keep the engine's defaults)."""
    options = {name: getattr(args, name, None) for name in ENGINE_OPTION_FLAGS}
    options = {name: value for name, value in options.items() if value is not None}
    if args.served_model_name:
        options["served_model_name"] = args.served_model_name
    return options


class _Server(uvicorn.Server):
    """uvicorn, but a signal means "shut down gracefully and return", not "re-raise the signal
    after shutdown" (which would turn a clean SIGTERM into exit status 143)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _open_local_engine(args: argparse.Namespace) -> tuple[EngineHandle, Path]:
    import openinfer

    model_path = args.model_path
    if not model_path:
        from openinfer.demo import ensure_demo_model

        model_path = ensure_demo_model()
        logger.info("no --model-path given: serving the demo model at %s", model_path)
    return openinfer.create_engine(str(model_path), **engine_options(args)), Path(model_path)


def _load_tokenizer(args: argparse.Namespace, engine: EngineHandle, model_path: Path | None) -> Tokenizer:
    directory = args.tokenizer or engine.info().tokenizer_path or (str(model_path) if model_path else "")
    if not directory:
        raise OpenInferError("the engine reports no tokenizer directory; pass --tokenizer DIR")
    return Tokenizer.from_dir(directory)


def _served_name(args: argparse.Namespace, engine: EngineHandle, model_path: Path | None) -> str:
    if args.served_model_name:
        return args.served_model_name
    if model_path is not None:
        return model_path.resolve().name
    info = engine.info()
    return info.model_id or Path(info.model_path).name or "model"


async def serve(args: argparse.Namespace) -> int:
    from openinfer.frontend.grpc import GrpcEngineClient, start_grpc_server
    from openinfer.frontend.http import create_app

    model_path: Path | None = None
    if args.engine:
        if args.model_path:
            raise OpenInferError("give either --model-path (local engine) or --engine grpc://... (remote), not both")
        ignored = sorted(set(engine_options(args)) - {"served_model_name"})
        if ignored:
            logger.warning("engine options %s are ignored with --engine: the remote engine has its own", ignored)
        remote = GrpcEngineClient(args.engine, args.api_key)
        logger.info("waiting up to %.0fs for the engine at %s", args.engine_timeout, args.engine)
        await asyncio.to_thread(remote.wait_until_ready, args.engine_timeout)
        engine: EngineHandle = remote
    else:
        engine, model_path = _open_local_engine(args)
    grpc_server = None
    try:
        tokenizer = _load_tokenizer(args, engine, model_path)
        name = _served_name(args, engine, model_path)
        app = create_app(engine, tokenizer, name, api_key=args.api_key, max_body_bytes=args.max_body_bytes)
        if args.grpc_port and not args.engine:
            grpc_server = await start_grpc_server(
                engine, args.host, args.grpc_port, args.api_key, sglang_model_name=name,
                tokenizer_path=str(Path(args.tokenizer).resolve()) if args.tokenizer else None)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, lifespan="off",
                                timeout_graceful_shutdown=args.shutdown_timeout)
        logger.info("serving %r over HTTP on %s:%d", name, args.host, args.port)
        await _Server(config).serve()
    finally:
        if grpc_server is not None:
            await grpc_server.stop(args.shutdown_timeout)
            logger.info("gRPC server stopped")
        await engine.close()
        logger.info("engine closed")
    return 0


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(serve(args))
    except OpenInferError as exc:
        logger.error("%s", exc)
        return 2
    except OSError as exc:  # e.g. a port already in use
        logger.error("cannot serve: %s", exc)
        return 1


def main(argv: list[str] | None = None) -> int:
    """``python -m openinfer.frontend.serve`` (the same as ``openinfer serve``)."""
    parser = argparse.ArgumentParser(prog="openinfer serve", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
