"""One API-server process of ``openinfer serve``: HTTP (and gRPC) in front of the engine core.

Started by the supervisor (``openinfer.frontend.supervisor``) as
``python -m openinfer.frontend.api_server``; it serves on the listening socket the supervisor
shares with every API server (``--listen-fd``), so N processes answer on one port. Its engine
is an ``EngineCoreClient`` (or a ``GrpcEngineClient`` with ``--engine grpc://``): the HTTP and
gRPC code see an ``EngineHandle`` as always. Only API server 0 serves gRPC on ``--grpc-port``,
bound without SO_REUSEPORT so that a port already in use stops the server (exit 3).
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
from openinfer.engine_core.stack_sampler import STACK_SAMPLES_ENV, StackSampler
from openinfer.engine_core.startup import (
    API_STARTUP_FILE,
    StartupPhases,
    memory_breakdown,
    note_event,
    startup_events,
)
from openinfer.frontend.serve import exit_status_of

logger = logging.getLogger("openinfer.api_server")
CORE_CONNECT_TIMEOUT_S = 3600.0


async def _connect_remote(args: argparse.Namespace, api_key: str | None) -> EngineHandle:
    """The remote engine (``--engine grpc://``) once it answers."""
    from openinfer.frontend.grpc import GrpcEngineClient

    remote = GrpcEngineClient(args.engine, api_key)
    logger.info("waiting up to %.0fs for the engine at %s", args.engine_timeout, args.engine)
    await asyncio.to_thread(remote.wait_until_ready, args.engine_timeout)
    return remote


async def serve_api(args: argparse.Namespace, listen_fd: int, run_dir: str, index: int,
                    phases: StartupPhases | None = None) -> int:
    import uvicorn

    from openinfer.frontend.http.metrics import ProcessTable
    from openinfer.frontend.serve import _served_name, build_app, make_server, resolve_api_key
    from openinfer.tokenizer import Tokenizer

    phases = phases or StartupPhases()
    serves_grpc = bool(args.grpc_port and not args.engine and index == 0)
    if serves_grpc:  # only the first API server answers gRPC: the others never import it
        from openinfer.frontend.grpc import start_grpc_server
    phases.mark("imports")
    note_event("imports_done")
    sock = socket.socket(fileno=listen_fd)
    api_key = resolve_api_key(args)  # the supervisor passes it in the environment, not argv
    # the tokenizer loads while the engine core loads the model (the core names the same
    # directory unless a plugin says otherwise; then it is loaded again below)
    guessed = args.tokenizer or (args.model_path if not args.engine else None)
    preloading = asyncio.create_task(asyncio.to_thread(_timed_load, Tokenizer.from_dir, guessed)) if guessed else None
    model_path = Path(args.model_path) if args.model_path else None
    client, connecting = _start_connect(args, run_dir, api_key)
    try:  # the app is built while the core loads, with the guessed tokenizer (checked once connected)
        early = await _early_app(args, client, model_path, preloading, api_key, ProcessTable(run_dir))
    except BaseException:
        connecting.cancel()
        raise
    phases.mark("tokenizer_and_app")
    engine = await connecting
    phases.mark("wait_for_engine")
    note_event("engine_connected")
    grpc_server = None
    try:
        tokenizer = await _preloaded_tokenizer(args, engine, model_path, guessed, preloading)
        name = _served_name(args, engine, model_path)
        if early is not None and tokenizer is early[0]:
            app = early[1]
        else:  # a tokenizer other than the guessed one (a plugin's), or a remote engine
            app = build_app(args, engine, tokenizer, name, api_key, processes=ProcessTable(run_dir))
            note_event("app_built")
        phases.mark("app_checked")
        # one gRPC listener per host: the first API server answers gRPC (no SO_REUSEPORT, so a second
        # process could not share the port; a port in use is a start-up error, exit 3)
        if serves_grpc:
            grpc_server = await start_grpc_server(
                engine, args.host, args.grpc_port, api_key, sglang_model_name=name,
                tokenizer_path=str(Path(args.tokenizer).resolve()) if args.tokenizer else None,
                worker_protocol=getattr(args, "grpc_worker_protocol", "sglang"))
            phases.mark("grpc_server")
        config = uvicorn.Config(app, log_level=args.log_level, lifespan="off",
                                timeout_graceful_shutdown=args.shutdown_timeout, access_log=False)
        if index == 0:
            logger.info("serving %r over HTTP on %s:%d", name, args.host, args.port)
        server = make_server(config)
        watcher = asyncio.create_task(_exit_with_supervisor(server))
        reporter = asyncio.create_task(_report_startup(server, phases, run_dir, index))
        await server.serve(sockets=[sock])
        watcher.cancel()
        reporter.cancel()
    finally:
        if preloading is not None and not preloading.done():
            preloading.cancel()
        if grpc_server is not None:
            await grpc_server.stop(args.shutdown_timeout)
        await engine.close()
    return 0


def _start_connect(args: argparse.Namespace, run_dir: str, api_key: str | None
                   ) -> tuple[EngineHandle | None, asyncio.Task]:
    """The task connecting to the engine, and the local engine core's client it connects (None for
    a remote engine: its client exists once it answers)."""
    if args.engine:
        return None, asyncio.create_task(_connect_remote(args, api_key))
    from openinfer.engine_core.client import EngineCoreClient

    client = EngineCoreClient(run_dir)

    async def connected() -> EngineHandle:
        # the supervisor watches the core (a failed start stops the server); loading a large model
        # may take long, so an API server waits for it as long as it takes within this bound
        await client.connect(CORE_CONNECT_TIMEOUT_S)
        return client

    return client, asyncio.create_task(connected())


async def _early_app(args: argparse.Namespace, client: EngineHandle | None, model_path: Path | None,
                     preloading: asyncio.Task | None, api_key: str | None, processes) -> tuple | None:
    """``(tokenizer, app)`` built before the engine core answers — with the tokenizer preloaded
    from the guessed directory — when the served name needs no answer from it; else None. Nothing
    in building the app asks the engine anything (it is asked per request)."""
    from openinfer.frontend.serve import _served_name, build_app

    if client is None or preloading is None or not (args.served_model_name or model_path is not None):
        return None
    try:
        tokenizer = await preloading
    except Exception:  # e.g. the model directory has no tokenizer: the engine's answer decides
        return None
    app = build_app(args, client, tokenizer, _served_name(args, client, model_path), api_key, processes=processes)
    note_event("app_built")
    return tokenizer, app


def _timed_load(load, directory: str):
    """``load(directory)``, noting when it is done (a start-up event)."""
    tokenizer = load(directory)
    note_event("tokenizer_preloaded")
    return tokenizer


async def _preloaded_tokenizer(args: argparse.Namespace, engine: EngineHandle, model_path: Path | None,
                               guessed: str | None, preloading: asyncio.Task | None):
    """The tokenizer of the directory the engine names: the one loaded meanwhile when it is that."""
    from openinfer.frontend.serve import _load_tokenizer

    if preloading is not None:
        directory = args.tokenizer or engine.info().tokenizer_path or guessed
        try:
            tokenizer = await preloading
        except Exception:  # e.g. the model directory has no tokenizer: the engine's answer decides
            tokenizer = None
        if tokenizer is not None and Path(directory).resolve() == Path(guessed).resolve():
            return tokenizer
    return _load_tokenizer(args, engine, model_path)


async def _report_startup(server, phases: StartupPhases, run_dir: str, index: int) -> None:
    """Once uvicorn listens: this process's start-up phases and memory, for the supervisor."""
    while not server.started:
        await asyncio.sleep(0.005)
    phases.mark("http_listening")
    path = Path(run_dir) / API_STARTUP_FILE.format(role=f"api-server-{index}")
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps({"phases": phases.as_dict(), "memory": memory_breakdown(),
                                     "events": startup_events(phases.started)}))
    temporary.replace(path)


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
    phases = StartupPhases()
    phases.mark("spawn_and_imports")  # interpreter start, openinfer
    ours = parser.parse_args(argv)
    args = argparse.Namespace(**json.loads(ours.args_json))
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[api-{ours.index}]: %(message)s")
    samples_path = os.environ.get(STACK_SAMPLES_ENV)  # the engine core writes PATH, API server i PATH.api-i
    sampler = StackSampler().start() if samples_path else None
    try:
        return exit_status_of(lambda: _run(serve_api(args, ours.listen_fd, ours.run_dir, ours.index, phases)), logger)
    except KeyboardInterrupt:
        return 0
    finally:
        if sampler is not None:
            sampler.stop()
            sampler.write(f"{samples_path}.api-{ours.index}")


if __name__ == "__main__":
    sys.exit(main())
