"""The engine-core process: scheduler, KV manager and model runner, behind ZMQ.

``openinfer serve`` starts it as ``python -m openinfer.engine_core`` and supervises it (see
``openinfer.frontend.supervisor``). One thread does everything: the engine thread polls the
input socket between steps (never blocking while there is work) and, at the end of each step,
sends every client ONE message with all of that step's entries for its requests. No other
thread touches a socket, so there is no lock and no GIL hand-over per message.

With ``OPENINFER_STEP_LOG=PATH`` in the environment, every launch is logged and written to PATH
on shutdown (``openinfer.engine_core.step_log``); with ``OPENINFER_STACK_SAMPLES=PATH``, every
thread's Python stack is sampled and the heaviest stacks written to PATH on shutdown
(``openinfer.engine_core.stack_sampler``).

Start-up protocol: the process writes one JSON line to ``--ready-fd`` — ``{"ok": true,
"pid": ...}`` once it serves, or ``{"ok": false, "error": ..., "exit_code": 2}`` when the model
cannot be loaded — and exits 2 on such errors (a supervisor does not restart those).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import logging
import os
import queue
import signal
import struct
import sys
import threading
import time
from typing import Any

import zmq

from openinfer.engine_core.protocol import (
    ABORT,
    ADD,
    CORE_INPUT_SOCKET,
    HEARTBEAT,
    HELLO,
    READY,
    STEP,
    decoder,
    encoder,
    ipc_address,
    load_fields,
    prompt_from_buffer,
)
from openinfer.engine_core.slots import REJECTED, TOKENS_PB
from openinfer.engine_core.stack_sampler import STACK_SAMPLES_ENV, StackSampler
from openinfer.engine_core.startup import (
    StartupPhases,
    early_cuda_wanted,
    freeze_startup_heap,
    memory_breakdown,
    note_event,
    start_cuda_early,
    startup_events,
)
from openinfer.engine_core.step_log import STEP_LOG_ENV, StepLog
from openinfer.errors import EngineDeadError, InvalidRequestError, OpenInferError, QueueFullError
from openinfer.v1 import engine_pb2 as pb

logger = logging.getLogger("openinfer.engine_core")

HEARTBEAT_S = 0.25
# OPENINFER_CORE_SPIN_MS=N: for N ms after its last message in or out, the engine thread polls the
# input socket without blocking instead of sleeping in poll: a request arriving then is read at
# once, not after the wake-up of an idle thread and core. It keeps a core busy meanwhile; 0 turns
# it off. Default 25 on a machine with at least SPIN_MIN_CPUS CPUs for this process: D1b (H200 host,
# served Qwen3-4B, 2 rounds x 7 prompts) warm TTFT 0.972x / 0.985x / 0.959x at 1k / 4k / 16k against 0
# (benchmarks/served_ttft.py); 0 below that (on 2 CPUs the spinning core starved the API server and the
# client: stub served warm TTFT 3.2 -> 11.5 ms at 1k)
CORE_SPIN_ENV = "OPENINFER_CORE_SPIN_MS"
DEFAULT_CORE_SPIN_MS = 25.0
SPIN_MIN_CPUS = 8


def available_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def spin_seconds() -> float:
    """``OPENINFER_CORE_SPIN_MS`` in seconds (0: off; unset: 25 ms with at least ``SPIN_MIN_CPUS``
    CPUs, else off); anything else is an error."""
    value = os.environ.get(CORE_SPIN_ENV)
    if value is None:
        return DEFAULT_CORE_SPIN_MS / 1e3 if available_cpus() >= SPIN_MIN_CPUS else 0.0
    try:
        milliseconds = float(value)
    except ValueError:
        milliseconds = -1.0
    if not 0 <= milliseconds <= 10_000:
        raise OpenInferError(f"{CORE_SPIN_ENV} must be a number of milliseconds in [0, 10000], got {value!r}")
    return milliseconds / 1e3


class CoreTransport:
    """The engine's inbox and output sink in the engine-core process (engine thread only)."""

    def __init__(self, engine: Any, run_dir: str, context: zmq.Context | None = None):
        self.engine = engine
        self.context = context or zmq.Context.instance()
        self.input = self.context.socket(zmq.PULL)
        self.input.setsockopt(zmq.RCVHWM, 0)
        self.input.setsockopt(zmq.LINGER, 0)
        path = os.path.join(run_dir, CORE_INPUT_SOCKET)
        if os.path.exists(path):  # left behind by a core that died
            os.unlink(path)
        self.input.bind(ipc_address(run_dir, CORE_INPUT_SOCKET))
        self.poller = zmq.Poller()
        self.poller.register(self.input, zmq.POLLIN)
        self.clients: dict[bytes, zmq.Socket] = {}
        self.monitors: dict[zmq.Socket, bytes] = {}
        self.local: collections.deque = collections.deque()
        self.last_sent = time.monotonic()
        self.num_step_messages = 0
        self.spin_s = spin_seconds()
        self.last_active = time.monotonic()  # the last message received or step delivered (spin window)

    # --- the engine's inbox protocol -------------------------------------------------------

    def put(self, item: Any) -> None:
        self.local.append(item)

    def get_nowait(self) -> Any:
        if not self.local:
            self._receive(0)
        if not self.local:
            raise queue.Empty
        return self.local.popleft()

    def get(self, timeout: float | None = None) -> Any:
        if not self.local and self.spin_s:
            end = self.last_active + self.spin_s
            while not self.local and time.monotonic() < end:
                self._receive(0)
        if not self.local:
            self._receive(HEARTBEAT_S if timeout is None else min(timeout, HEARTBEAT_S))
        if not self.local:
            raise queue.Empty
        return self.local.popleft()

    # --- input -----------------------------------------------------------------------------

    def _receive(self, timeout_s: float) -> None:
        events = dict(self.poller.poll(int(timeout_s * 1000)))
        if self.input in events:
            while True:
                try:
                    frame = self.input.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                client_id, commands = decoder.decode(frame.buffer)
                self._handle(client_id, commands)
                self.last_active = time.monotonic()
        for monitor in [m for m in events if m is not self.input]:
            self._on_monitor_event(monitor)
        if time.monotonic() - self.last_sent > HEARTBEAT_S:
            self._heartbeat()

    def _handle(self, client_id: bytes, commands: list) -> None:
        for command, argument, *rest in commands:
            if command == ADD:
                request = pb.GenerateRequest.FromString(argument)
                try:
                    # the prompt as one buffer beside the request (protocol: ADD), read in place
                    prompt = prompt_from_buffer(rest[0]) if rest else None
                    self.engine.admit(request, client_id, prompt)
                except InvalidRequestError as exc:
                    self.local.append(("reject", (client_id, request.request_id, REJECTED,
                                                  [pb.ERROR_CODE_INVALID_ARGUMENT, str(exc), exc.field or ""])))
                except QueueFullError as exc:
                    self.local.append(("reject", (client_id, request.request_id, REJECTED,
                                                  [pb.ERROR_CODE_RESOURCE_EXHAUSTED, str(exc), exc.max_queue])))
                except (EngineDeadError, OpenInferError) as exc:
                    self.local.append(("reject", (client_id, request.request_id, REJECTED,
                                                  [pb.ERROR_CODE_UNAVAILABLE, str(exc), ""])))
            elif command == ABORT:
                self.local.append(("abort", argument))
            elif command == HELLO:
                self._connect_client(client_id, argument)

    def _connect_client(self, client_id: bytes, address: str) -> None:
        old = self.clients.pop(client_id, None)
        if old is not None:
            self._drop_socket(old)
        sock = self.context.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)  # never drop a step message
        sock.setsockopt(zmq.LINGER, 0)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(address)
        self.clients[client_id] = sock
        self.monitors[monitor] = client_id
        self.poller.register(monitor, zmq.POLLIN)
        health = self.engine.health()
        info = self.engine.info()
        sock.send(encoder.encode([READY, info.SerializeToString(), health.healthy, health.message, os.getpid()]))
        logger.info("frontend %s connected", client_id.decode(errors="replace"))

    def _on_monitor_event(self, monitor: zmq.Socket) -> None:
        try:
            frames = monitor.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        event = struct.unpack("=hi", frames[0][:6])[0]
        client_id = self.monitors.get(monitor)
        if event != zmq.EVENT_DISCONNECTED or client_id is None:
            return
        # the frontend process is gone: its requests have nobody to stream to
        logger.warning("frontend %s disconnected; aborting its requests", client_id.decode(errors="replace"))
        sock = self.clients.pop(client_id, None)
        del self.monitors[monitor]
        self.poller.unregister(monitor)
        if sock is not None:
            sock.disable_monitor()
            sock.close(0)
        monitor.close(0)
        for request_id in self.engine.requests_of(client_id):
            self.local.append(("abort", request_id))

    def _drop_socket(self, sock: zmq.Socket) -> None:
        for monitor, _ in [(m, c) for m, c in self.monitors.items() if self.clients.get(c) is sock]:
            self.poller.unregister(monitor)
            del self.monitors[monitor]
            monitor.close(0)
        sock.close(0)

    # --- output ----------------------------------------------------------------------------

    def deliver(self, entries: list) -> None:
        """One STEP message per client with all of this step's entries for its requests."""
        by_client: dict[bytes, list] = {}
        for client_id, request_id, kind, payload in entries:
            if kind == TOKENS_PB:
                payload = payload.SerializeToString()
            by_client.setdefault(client_id, []).append((request_id, kind, payload))
        load = load_fields(self.engine.load())
        for client_id, items in by_client.items():
            sock = self.clients.get(client_id)
            if sock is not None:
                sock.send(encoder.encode([STEP, items, load]), copy=False)
                self.num_step_messages += 1
        self.last_sent = self.last_active = time.monotonic()

    def _heartbeat(self) -> None:
        health = self.engine.health()
        message = encoder.encode([HEARTBEAT, load_fields(self.engine.load()), health.healthy, health.message])
        for sock in self.clients.values():
            sock.send(message)
        self.last_sent = time.monotonic()

    def close(self) -> None:
        for monitor in list(self.monitors):
            monitor.close(0)
        for sock in self.clients.values():
            sock.close(0)
        self.input.close(0)


def load_factory(spec: str | None):
    """``module:function`` → the function (default ``openinfer.create_engine``)."""
    if not spec:
        import openinfer

        return openinfer.create_engine
    module, _, name = spec.partition(":")
    if not module or not name:
        raise OpenInferError(f"engine factory {spec!r} must look like module:function")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise OpenInferError(f"cannot import the engine factory {spec!r}: {exc}") from exc


def build_engine(model_path: str | None, options: dict[str, Any], factory: str | None) -> Any:
    if not model_path:
        from openinfer.demo import ensure_demo_model

        model_path = str(ensure_demo_model())
        logger.info("no --model-path given: serving the demo model at %s", model_path)
    engine = load_factory(factory)(model_path, **options)
    if not hasattr(engine, "attach_transport"):
        from openinfer.engine_core.adapter import HandleAdapter

        engine = HandleAdapter(engine)
    return engine


def _report(fd: int | None, payload: dict) -> None:
    if fd is None:
        return
    with os.fdopen(fd, "w") as pipe:
        pipe.write(json.dumps(payload) + "\n")


def main(argv: list[str] | None = None) -> int:
    phases = StartupPhases()
    phases.mark("spawn_and_imports")  # interpreter start, openinfer, ZMQ, msgspec
    note_event("imports_done")
    parser = argparse.ArgumentParser(prog="python -m openinfer.engine_core", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--model-path", default="")
    parser.add_argument("--options-json", default="{}")
    parser.add_argument("--engine-factory", default=None)
    parser.add_argument("--ready-fd", type=int, default=None)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s")
    parent = os.getppid()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stack_samples_path = os.environ.get(STACK_SAMPLES_ENV)  # sampled from here: the start-up included
    sampler = StackSampler().start() if stack_samples_path else None
    try:
        options = json.loads(args.options_json)
        if early_cuda_wanted(options):
            start_cuda_early()
        note_event("engine_build_started")
        engine = build_engine(args.model_path, options, args.engine_factory)
    except OpenInferError as exc:
        logger.error("%s", exc)
        _report(args.ready_fd, {"ok": False, "error": str(exc), "exit_code": 2})
        return 2
    except Exception as exc:
        logger.exception("the engine could not be built")
        _report(args.ready_fd, {"ok": False, "error": repr(exc), "exit_code": 1})
        return 1
    phases.mark("engine_build")
    # plugin discovery, backend start, weights: what the engine does not time itself
    phases.split("engine_build", getattr(engine, "startup_phases", {}), rest="model_load")
    # the engine's factory gave back what loading left on the host (create_paged_engine calls
    # release_host_memory); this process only reports what stays resident
    memory = memory_breakdown()
    step_log_path = os.environ.get(STEP_LOG_ENV)
    step_log = StepLog.attach(engine) if step_log_path else None
    transport = CoreTransport(engine, args.run_dir)
    engine.attach_transport(transport, transport.deliver)
    phases.mark("transport")
    frozen = freeze_startup_heap()
    phases.mark("gc_freeze")
    note_event("ready")
    _report(args.ready_fd, {"ok": True, "pid": os.getpid(), "phases": phases.as_dict(), "memory": memory,
                            "events": startup_events(phases.started)})
    logger.info("engine core serving (pid %d); start-up %s; host memory %s; %d start-up objects frozen for the GC",
                os.getpid(), json.dumps(phases.as_dict()), json.dumps(memory), frozen)
    code = 0
    while not stop.wait(0.2):
        if not engine.health().healthy:
            logger.error("engine is unhealthy (%s); exiting so the supervisor restarts it", engine.health().message)
            code = 1
            break
        if os.getppid() != parent:  # the supervisor is gone: nobody will stop us
            logger.warning("supervisor exited; shutting down")
            break
    engine.close_sync()
    if step_log is not None:
        try:
            step_log.write(step_log_path, getattr(engine, "step_timer", None))
        except OSError as exc:
            logger.error("cannot write the step log to %s: %s", step_log_path, exc)
    if sampler is not None:
        sampler.stop()
        try:
            sampler.write(stack_samples_path)
        except OSError as exc:
            logger.error("cannot write the stack samples to %s: %s", stack_samples_path, exc)
    return code


if __name__ == "__main__":
    sys.exit(main())
