"""One API-server process of ``openinfer serve``: HTTP (and gRPC) in front of the engine core.

Started by the supervisor (``openinfer.frontend.supervisor``) as
``python -m openinfer.frontend.api_server``; it serves on the listening socket the supervisor
shares with every API server (``--listen-fd``), so N processes answer on one port. Its engine
is an ``EngineCoreClient`` (or a ``GrpcEngineClient`` with ``--engine grpc://``): the HTTP and
gRPC code see an ``EngineHandle`` as always. The gRPC server binds with SO_REUSEPORT (gRPC's
default), so every API server also answers on ``--grpc-port``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import sys
from pathlib import Path

from openinfer.engine import EngineHandle
from openinfer.frontend.serve import exit_status_of

logger = logging.getLogger("openinfer.api_server")
CORE_CONNECT_TIMEOUT_S = 3600.0


async def _connect(args: argparse.Namespace, run_dir: str, api_key: str | None) -> EngineHandle:
    if args.engine:
        from openinfer.frontend.grpc import GrpcEngineClient

        remote = GrpcEngineClient(args.engine, api_key)
        logger.info("waiting up to %.0fs for the engine at %s", args.engine_timeout, args.engine)
        await asyncio.to_thread(remote.wait_until_ready, args.engine_timeout)
        return remote
    from openinfer.engine_core.client import EngineCoreClient

    client = EngineCoreClient(run_dir)
    # the supervisor watches the core (a failed start stops the server); loading a large model
    # may take long, so an API server waits for it as long as it takes within this bound
    await client.connect(CORE_CONNECT_TIMEOUT_S)
    return client


async def serve_api(args: argparse.Namespace, listen_fd: int, run_dir: str, index: int) -> int:
    import uvicorn

    from openinfer.frontend.grpc import start_grpc_server
    from openinfer.frontend.http.metrics import ProcessTable
    from openinfer.frontend.serve import _load_tokenizer, _served_name, _Server, build_app, resolve_api_key

    sock = socket.socket(fileno=listen_fd)
    api_key = resolve_api_key(args)  # the supervisor passes it in the environment, not argv
    engine = await _connect(args, run_dir, api_key)
    model_path = Path(args.model_path) if args.model_path else None
    grpc_server = None
    try:
        tokenizer = _load_tokenizer(args, engine, model_path)
        name = _served_name(args, engine, model_path)
        app = build_app(args, engine, tokenizer, name, api_key, processes=ProcessTable(run_dir))
        # one gRPC listener per host: the first API server answers gRPC (no SO_REUSEPORT, so a second
        # process could not share the port; a port in use is a start-up error, exit 3)
        if args.grpc_port and not args.engine and index == 0:
            grpc_server = await start_grpc_server(
                engine, args.host, args.grpc_port, api_key, sglang_model_name=name,
                tokenizer_path=str(Path(args.tokenizer).resolve()) if args.tokenizer else None,
                worker_protocol=getattr(args, "grpc_worker_protocol", "sglang"))
        config = uvicorn.Config(app, log_level=args.log_level, lifespan="off",
                                timeout_graceful_shutdown=args.shutdown_timeout, access_log=False)
        if index == 0:
            logger.info("serving %r over HTTP on %s:%d", name, args.host, args.port)
        server = _Server(config)
        watcher = asyncio.create_task(_exit_with_supervisor(server))
        await server.serve(sockets=[sock])
        watcher.cancel()
    finally:
        if grpc_server is not None:
            await grpc_server.stop(args.shutdown_timeout)
        await engine.close()
    return 0


async def _exit_with_supervisor(server) -> None:
    """Shut down when the supervisor is gone (it would have stopped us; nobody else will)."""
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(0.5)
    logger.warning("the supervisor exited; shutting down")
    server.should_exit = True


def _run(main_coroutine):
    """uvloop when installed (a faster event loop for many concurrent streams), else asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main_coroutine)
    return uvloop.run(main_coroutine)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m openinfer.frontend.api_server")
    parser.add_argument("--listen-fd", type=int, required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--args-json", required=True, help="the `openinfer serve` arguments")
    ours = parser.parse_args(argv)
    args = argparse.Namespace(**json.loads(ours.args_json))
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[api-{ours.index}]: %(message)s")
    try:
        return exit_status_of(lambda: _run(serve_api(args, ours.listen_fd, ours.run_dir, ours.index)), logger)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
