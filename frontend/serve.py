"""``openinfer serve``: the HTTP server (and, for a local engine, the gRPC server) of one model.

``add_arguments`` declares the flags, ``run`` serves until SIGINT/SIGTERM and returns the exit
code. By default the engine runs in its own engine-core process and HTTP/gRPC in
``--api-server-count`` API-server processes, all supervised (``openinfer.frontend.supervisor``);
``--single-process`` keeps everything in one process (engine thread + event loop). Engine flags are forwarded untouched as options to ``openinfer.create_engine`` (their
names are the fields of ``openinfer.options.EngineOptions``); a flag left out keeps the
engine's default. Shutdown order: stop accepting (HTTP and gRPC), let in-flight requests finish
for ``--shutdown-timeout`` seconds (then they are cancelled and aborted), close the engine, exit 0.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from openinfer.cli_types import INT32_MAX, UINT64_MAX, float_range, int_range, non_empty, port
from openinfer.errors import OpenInferError, PortInUseError
from openinfer.options import SCHEDULER_POLICIES

if TYPE_CHECKING:
    from openinfer.engine import EngineHandle
    from openinfer.tokenizer import Tokenizer

# Nothing here imports uvicorn, FastAPI, the tokenizer, asyncio or the engine at module level: `openinfer
# serve` runs this module in the supervisor, which needs none of them (start-up time and idle memory).

logger = logging.getLogger("openinfer.serve")
API_KEY_ENV = "OPENINFER_API_KEY"
STARTUP_FAILURE = 3  # uvicorn's exit status when it cannot bind; the gRPC port gives the same

# flags forwarded to openinfer.create_engine; each dest is an EngineOptions field
ENGINE_OPTION_FLAGS = ("device", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks",
                       "gpu_memory_utilization", "enable_prefix_cache", "cuda_graph", "async_scheduling",
                       "max_queue", "seed", "trace_dir", "tensor_parallel_size", "expert_parallel_size",
                       "attention_data_parallel", "scheduler_policy", "load_format")


def _bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag with its range: a value outside it is a usage error (exit 2) naming the flag."""
    model = parser.add_argument_group("model")
    model.add_argument("--model-path", type=non_empty("--model-path"),
                       help="model directory (config.json, *.safetensors, tokenizer.json); default: the demo model")
    model.add_argument("--engine", type=_engine_url,
                       help="serve a remote engine instead of a local model: grpc://HOST:PORT")
    model.add_argument("--engine-timeout", type=float_range(0, low_inclusive=False), default=60.0,
                       help="seconds to wait for the --engine to answer at start-up (default 60)")
    model.add_argument("--tokenizer", type=non_empty("--tokenizer"),
                       help="tokenizer directory (default: the model's own; with --engine, the tokenizer path "
                            "the remote engine reports)")
    model.add_argument("--served-model-name", type=non_empty("--served-model-name"),
                       help="model name clients send (default: the directory name)")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", type=non_empty("--host"),
                        help="address to bind (default 127.0.0.1, this machine only; binding another address "
                             "without an API key logs a warning)")
    server.add_argument("--port", type=port(), default=8000, help="HTTP port, 1-65535 (default 8000)")
    server.add_argument("--grpc-port", type=port(allow_zero=True), default=50051,
                        help="gRPC port, 1-65535: openinfer.v1.Engine, grpc.health.v1 and the SGLang scheduler "
                             "service for the smg router (default 50051; 0 disables; not served with --engine)")
    server.add_argument("--grpc-worker-protocol", choices=["sglang", "vllm"], default="sglang",
                        help="the smg router's worker protocol served on --grpc-port: the SGLang scheduler "
                             "service (default) or smg's vLLM-engine service (vllm_engine.proto)")
    keys = server.add_mutually_exclusive_group()
    keys.add_argument("--api-key", type=non_empty("--api-key"),
                      help="require 'Authorization: Bearer KEY' (HTTP) / the same gRPC metadata; visible in "
                           f"the process list, so prefer --api-key-file or ${API_KEY_ENV}")
    keys.add_argument("--api-key-file", metavar="PATH", type=non_empty("--api-key-file"),
                      help=f"read the API key from this file (first line); default: ${API_KEY_ENV} if set")
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    server.add_argument("--max-body-bytes", type=int_range(1024, INT32_MAX), default=16 * 1024 * 1024,
                        help="largest accepted HTTP request body, 1024-2**31-1 (default 16 MiB; larger → 413)")
    server.add_argument("--shutdown-timeout", type=float_range(0), default=30.0,
                        help="seconds in-flight requests get to finish on SIGINT/SIGTERM (default 30)")
    server.add_argument("--max-queue-wait", type=float_range(0),
                        help="seconds an HTTP request may wait in the engine's queue before it is aborted and "
                             "answered 503 with Retry-After (default: ServerLimits' 60; 0 waits forever)")
    server.add_argument("--default-max-tokens", type=int_range(1, INT32_MAX),
                        help="cap on generated tokens for requests that give no max_tokens (default: as vLLM, "
                             "the model's generation_config max_new_tokens, else the rest of the context)")
    server.add_argument("--api-server-count", type=int_range(1, 256), default=1,
                        help="HTTP server processes sharing the port; the first also serves gRPC (default 1: on the 2-core CPU box one "
                             "process keeps up with the stub engine at 256 streams; raise it on GPU hosts)")
    server.add_argument("--startup-report", metavar="PATH", type=non_empty("--startup-report"),
                        help="write where the start went (per process: spawn, imports, model load, KV, graphs, "
                             "HTTP; idle host memory) as JSON to PATH once HTTP is ready")
    server.add_argument("--single-process", action="store_true",
                        help="run the engine as a thread of the HTTP process (no engine-core process, no "
                             "supervision); for debugging and comparisons")
    server.add_argument("--engine-factory", metavar="MODULE:FUNCTION",
                        help="build the engine with FUNCTION(model_path, **engine options) instead of "
                             "openinfer.create_engine (tests, benchmarks: openinfer.engine_core.stub:create_stub_engine)")
    engine = parser.add_argument_group("engine (forwarded to openinfer.create_engine)")
    engine.add_argument("--device", choices=["auto", "cuda", "cpu"], help="default auto")
    engine.add_argument("--max-model-len", type=int_range(2, INT32_MAX),
                        help="context length, >= 2 (default: the model's)")
    engine.add_argument("--max-num-seqs", type=int_range(1, INT32_MAX),
                        help="most requests in one batch, >= 1 (default 256)")
    engine.add_argument("--max-num-batched-tokens", type=int_range(1, INT32_MAX),
                        help="token budget of one step, >= 1 (default 8192 on cuda, 512 on cpu)")
    engine.add_argument("--num-kv-blocks", type=int_range(1, INT32_MAX),
                        help="KV pool size in blocks, >= 1 (default: sized from memory)")
    engine.add_argument("--gpu-memory-utilization", type=float_range(0, 1, low_inclusive=False),
                        help="fraction of GPU memory to use, in (0, 1]")
    engine.add_argument("--no-prefix-cache", dest="enable_prefix_cache", action="store_const", const=False,
                        help="disable prefix caching")
    engine.add_argument("--cuda-graph", type=_bool, metavar="true|false", help="capture decode CUDA graphs")
    engine.add_argument("--async-scheduling", type=_bool, metavar="true|false",
                        help="launch step N+1 before reading step N back (default: on for cuda)")
    engine.add_argument("--max-queue", type=int_range(1, INT32_MAX),
                        help="requests that may wait for a batch slot, >= 1; one more is answered 503 "
                             "(default 1024)")
    engine.add_argument("--seed", type=int_range(0, UINT64_MAX), help="engine seed for unseeded sampling, >= 0")
    engine.add_argument("--trace-dir", type=non_empty("--trace-dir"),
                        help="write one Chrome-trace JSON per request into this directory "
                             "(open in ui.perfetto.dev); off by default")
    engine.add_argument("--tensor-parallel-size", type=int_range(1, 1024),
                        help="ranks splitting every layer by heads / rows, one GPU each (default 1)")
    engine.add_argument("--expert-parallel-size", type=int_range(1, 1024),
                        help="ranks splitting the MoE experts, one GPU each (default 1)")
    engine.add_argument("--enable-attention-data-parallel", dest="attention_data_parallel", action="store_const",
                        const=True, help="with --expert-parallel-size >= 2: each rank attends for its own "
                                         "sequences and caches only their KV (not with tensor parallel)")
    engine.add_argument("--scheduler-policy", choices=list(SCHEDULER_POLICIES),
                        help="mixed: decodes ride along with prompt chunks (default); split: alternate "
                             "decode-only and prompt-only steps; prefill_first: prompt steps while any can run")
    engine.add_argument("--load-format", choices=["auto", "dummy"],
                        help="dummy: random weights at the real shapes, no checkpoint needed")


def _engine_url(text: str) -> str:
    if not text.startswith("grpc://") or len(text) <= len("grpc://"):
        raise argparse.ArgumentTypeError(f"expected grpc://HOST:PORT, got {text!r}")
    return text


def resolve_api_key(args: argparse.Namespace) -> str | None:
    """The API key from --api-key, --api-key-file or the environment, in that order."""
    if getattr(args, "api_key", None):
        return args.api_key
    path = getattr(args, "api_key_file", None)
    if path:
        try:
            key = Path(path).read_text(encoding="utf-8").strip().splitlines()
        except OSError as exc:
            raise OpenInferError(f"cannot read --api-key-file {path}: {exc.strerror or exc}") from exc
        if not key or not key[0].strip():
            raise OpenInferError(f"--api-key-file {path} is empty; write the key on its first line")
        return key[0].strip()
    return os.environ.get(API_KEY_ENV, "").strip() or None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags the user gave (unset ones keep the engine's defaults)."""
    options = {name: getattr(args, name, None) for name in ENGINE_OPTION_FLAGS}
    options = {name: value for name, value in options.items() if value is not None}
    if args.served_model_name:
        options["served_model_name"] = args.served_model_name
    return options


def make_server(config: Any) -> Any:
    """A ``uvicorn.Server`` for which a signal means "shut down gracefully and return", not
    "re-raise the signal after shutdown" (which would turn a clean SIGTERM into exit status 143)."""
    import uvicorn

    class Server(uvicorn.Server):
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

    return Server(config)


def _open_local_engine(args: argparse.Namespace) -> tuple[EngineHandle, Path]:
    import openinfer

    model_path = args.model_path
    if not model_path:
        from openinfer.demo import ensure_demo_model

        model_path = ensure_demo_model()
        logger.info("no --model-path given: serving the demo model at %s", model_path)
    if getattr(args, "engine_factory", None):
        from openinfer.engine_core.process import load_factory

        return load_factory(args.engine_factory)(str(model_path), **engine_options(args)), Path(model_path)
    return openinfer.create_engine(str(model_path), **engine_options(args)), Path(model_path)


def _load_tokenizer(args: argparse.Namespace, engine: EngineHandle, model_path: Path | None) -> Tokenizer:
    from openinfer.tokenizer import Tokenizer

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


def build_app(args: argparse.Namespace, engine: EngineHandle, tokenizer: Tokenizer, name: str,
              api_key: str | None, processes: Any = None) -> Any:
    """The HTTP app with every server flag applied (one place for the in-process and the API-server paths)."""
    from openinfer.frontend.http import create_app
    from openinfer.frontend.http.context import DEFAULT_MAX_QUEUE_WAIT_S, ServerLimits

    wait = DEFAULT_MAX_QUEUE_WAIT_S if args.max_queue_wait is None else args.max_queue_wait
    limits = ServerLimits(max_queue_wait_s=wait or None, default_max_tokens=args.default_max_tokens)
    return create_app(engine, tokenizer, name, api_key=api_key, max_body_bytes=args.max_body_bytes,
                      limits=limits, processes=processes, trace_dir=getattr(args, "trace_dir", None))


def warn_if_exposed(args: argparse.Namespace, api_key: str | None) -> None:
    if not api_key and not is_loopback(args.host):
        logger.warning("binding %s, reachable from other machines, without an API key: anyone who can reach it "
                       "can use the model; set %s or pass --api-key-file", args.host, API_KEY_ENV)


def warn_ignored_engine_options(args: argparse.Namespace) -> None:
    """With --engine the remote engine has its own options; the frontend still uses these two."""
    ignored = sorted(set(engine_options(args)) - {"served_model_name", "trace_dir"})
    if ignored:
        logger.warning("engine options %s are ignored with --engine: the remote engine has its own", ignored)


async def serve(args: argparse.Namespace) -> int:
    import asyncio

    from openinfer.frontend.grpc import GrpcEngineClient, start_grpc_server

    model_path: Path | None = None
    api_key = resolve_api_key(args)
    warn_if_exposed(args, api_key)
    if args.engine:
        if args.model_path:
            raise OpenInferError("give either --model-path (local engine) or --engine grpc://... (remote), not both")
        warn_ignored_engine_options(args)
        remote = GrpcEngineClient(args.engine, api_key)
        logger.info("waiting up to %.0fs for the engine at %s", args.engine_timeout, args.engine)
        await asyncio.to_thread(remote.wait_until_ready, args.engine_timeout)
        engine: EngineHandle = remote
    else:
        engine, model_path = _open_local_engine(args)  # create_paged_engine released the load's host memory
    grpc_server = None
    try:
        tokenizer = _load_tokenizer(args, engine, model_path)
        name = _served_name(args, engine, model_path)
        app = build_app(args, engine, tokenizer, name, api_key)
        if args.grpc_port and not args.engine:
            grpc_server = await start_grpc_server(
                engine, args.host, args.grpc_port, api_key, sglang_model_name=name,
                tokenizer_path=str(Path(args.tokenizer).resolve()) if args.tokenizer else None,
                worker_protocol=args.grpc_worker_protocol)
        import uvicorn

        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, lifespan="off",
                                timeout_graceful_shutdown=args.shutdown_timeout)
        logger.info("serving %r over HTTP on %s:%d", name, args.host, args.port)
        await make_server(config).serve()
    finally:
        if grpc_server is not None:
            await grpc_server.stop(args.shutdown_timeout)
            logger.info("gRPC server stopped")
        await engine.close()
        logger.info("engine closed")
    return 0


def exit_status_of(serve_until_done: Callable[[], int], log: logging.Logger) -> int:
    """``serve_until_done()``'s status, or the exit status of its startup failure (logged): the
    port is taken -> STARTUP_FAILURE, a bad option or model (``OpenInferError``) -> 2."""
    try:
        return serve_until_done()
    except PortInUseError as exc:
        log.error("cannot serve: %s", exc)
        return STARTUP_FAILURE
    except OpenInferError as exc:
        log.error("%s", exc)
        return 2


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.engine and args.model_path:
        logger.error("give either --model-path (local engine) or --engine grpc://... (remote), not both")
        return 2
    if not getattr(args, "single_process", True):
        from openinfer.frontend.supervisor import Supervisor

        options = engine_options(args)
        if args.engine:
            warn_ignored_engine_options(args)
        try:
            api_key = resolve_api_key(args)
        except OpenInferError as exc:
            logger.error("%s", exc)
            return 2
        warn_if_exposed(args, api_key)
        return Supervisor(args, options, api_key).run()
    import asyncio  # here: the supervisor (above) never needs an event loop

    try:
        return exit_status_of(lambda: asyncio.run(serve(args)), logger)
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
