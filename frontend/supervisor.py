"""``openinfer serve``'s process model: a supervisor, one engine-core process, N API servers.

::

    supervisor (this module: no model, no HTTP; starts, watches and restarts the others)
      ├── engine core   python -m openinfer.engine_core      scheduler, KV, model (one GPU)
      └── API server ×N python -m openinfer.frontend.api_server   HTTP + gRPC, on one shared socket

The supervisor binds the HTTP socket once and hands it to every API server (``pass_fds``), so
the port stays open while an API server restarts. A child that exits unexpectedly is restarted
after a backoff (0.5 s, 1 s, 2 s, ... at most 8 s); more than ``MAX_RESTARTS`` restarts of one
role within ``RESTART_WINDOW_S`` seconds stop the server with exit code 1. While the core is
down the API servers answer 503 (``/health`` too) and fail in-flight requests at once.

Shutdown (SIGINT/SIGTERM): the API servers stop accepting and get ``--shutdown-timeout`` to
finish their streams, then the engine core is stopped; exit 0. Children run in their own
session, so a Ctrl-C reaches only the supervisor, which orders the shutdown; they exit by
themselves if the supervisor disappears.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field

from openinfer.engine_core.startup import (
    API_STARTUP_FILE,
    SPAWN_TIME_ENV,
    StartupPhases,
    note_event,
    startup_events,
)
from openinfer.frontend.serve import STARTUP_FAILURE

logger = logging.getLogger("openinfer.supervisor")

MAX_RESTARTS = 5
FATAL_EXIT_CODES = (2, STARTUP_FAILURE)  # usage errors and ports in use: restarting cannot help
RESTART_WINDOW_S = 120.0
POLL_S = 0.05
PROCESS_TABLE = "processes.json"
API_KEY_ENV = "OPENINFER_API_KEY"  # how the API key reaches the API servers (never argv)


@dataclass
class Child:
    role: str  # "engine-core" or "api-server-N"
    process: subprocess.Popen | None = None
    ready_fd: int | None = None  # engine core: the read end of its ready pipe, until it reports
    restarts: deque = field(default_factory=deque)
    restart_at: float | None = None  # monotonic time of a scheduled restart


def backoff_s(recent_restarts: int) -> float:
    return min(8.0, 0.5 * 2 ** max(0, recent_restarts - 1))


def listen_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(4096)
    sock.set_inheritable(True)
    return sock


class Supervisor:
    def __init__(self, args: argparse.Namespace, engine_options: dict, api_key: str | None = None):
        self.args = args
        self.api_key = api_key
        self.engine_options = engine_options
        self.run_dir = tempfile.mkdtemp(prefix="openinfer-")
        self.stopping = False
        self.core = Child("engine-core") if not args.engine else None
        self.api = [Child(f"api-server-{i}") for i in range(args.api_server_count)]
        self.sock: socket.socket | None = None
        self.exit_code = 1  # what run() returns when a child cannot be kept running
        self.phases = StartupPhases()  # from this process's start: the `openinfer serve` imports count
        self.phases.mark("spawn_and_imports")
        self.startup: dict | None = {}  # role -> its start-up report, until all are in (then None)

    # --- children --------------------------------------------------------------------------

    def _start_core(self) -> None:
        assert self.core is not None
        read_fd, write_fd = os.pipe()
        command = [sys.executable, "-m", "openinfer.engine_core", "--run-dir", self.run_dir,
                   "--options-json", json.dumps(self.engine_options), "--ready-fd", str(write_fd),
                   "--log-level", self.args.log_level]
        if self.args.model_path:
            command += ["--model-path", self.args.model_path]
        if self.args.engine_factory:
            command += ["--engine-factory", self.args.engine_factory]
        env = {**os.environ, SPAWN_TIME_ENV: repr(time.time())}
        self.core.process = subprocess.Popen(command, pass_fds=(write_fd,), start_new_session=True, env=env)
        note_event("core_spawned")
        os.close(write_fd)
        self.core.ready_fd = read_fd
        self._write_table()

    def _start_api(self, index: int) -> None:
        assert self.sock is not None
        child = self.api[index]
        args = {k: v for k, v in _plain(vars(self.args)).items() if k not in ("api_key", "api_key_file")}
        command = [sys.executable, "-m", "openinfer.frontend.api_server", "--listen-fd", str(self.sock.fileno()),
                   "--run-dir", self.run_dir, "--index", str(index), "--args-json", json.dumps(args)]
        env = {**os.environ, SPAWN_TIME_ENV: repr(time.time())}
        env.pop(API_KEY_ENV, None)
        if self.api_key:  # through the environment: a command line is visible to every user
            env[API_KEY_ENV] = self.api_key
        child.process = subprocess.Popen(command, pass_fds=(self.sock.fileno(),), start_new_session=True, env=env)
        self._write_table()

    def _write_table(self) -> None:
        """Pids of every process, for the API servers' per-process RSS in /metrics."""
        table = {"supervisor": os.getpid()}
        for child in [self.core, *self.api]:
            if child is not None and child.process is not None and child.process.poll() is None:
                table[child.role] = child.process.pid
        path = os.path.join(self.run_dir, PROCESS_TABLE)
        with open(path + ".tmp", "w") as handle:
            json.dump(table, handle)
        os.replace(path + ".tmp", path)

    def _read_ready(self, block: bool) -> dict | None:
        """The core's start-up report, or None while it is still loading."""
        assert self.core is not None and self.core.ready_fd is not None
        readable, _, _ = select.select([self.core.ready_fd], [], [], None if block else 0)
        if not readable:
            return None
        data = b""
        while not data.endswith(b"\n"):
            chunk = os.read(self.core.ready_fd, 4096)
            if not chunk:
                break
            data += chunk
        os.close(self.core.ready_fd)
        self.core.ready_fd = None
        try:
            return json.loads(data or b"{}") or {"ok": False, "error": "the engine core exited while starting",
                                                  "exit_code": 1}
        except ValueError:
            return {"ok": False, "error": f"unreadable start-up report {data!r}", "exit_code": 1}

    def _schedule_restart(self, child: Child, why: str) -> bool:
        """Plan a restart after the backoff; False when the restart budget is spent."""
        now = time.monotonic()
        while child.restarts and now - child.restarts[0] > RESTART_WINDOW_S:
            child.restarts.popleft()
        if len(child.restarts) >= MAX_RESTARTS:
            logger.error("%s %s; it was restarted %d times in %.0f s: giving up", child.role, why,
                         len(child.restarts), RESTART_WINDOW_S)
            return False
        child.restarts.append(now)
        delay = backoff_s(len(child.restarts))
        logger.error("%s %s; restarting it in %.1f s (restart %d of at most %d per %.0f s)", child.role, why, delay,
                     len(child.restarts), MAX_RESTARTS, RESTART_WINDOW_S)
        child.restart_at = now + delay
        child.process = None
        return True

    # --- the loop --------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stopping = True

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._stop_children()
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _run(self) -> int:
        try:
            self.sock = listen_socket(self.args.host, self.args.port)
        except OSError as exc:
            logger.error("cannot serve: the HTTP server cannot bind %s:%d (%s); choose another --port",
                         self.args.host, self.args.port, exc.strerror or exc)
            return STARTUP_FAILURE
        if self.core is not None:
            self._start_core()
        # the API servers import and connect while the core loads the model (they answer 503
        # until it is ready): start-up costs max(core, API server), not their sum
        for index in range(len(self.api)):
            self._start_api(index)
        if self.core is not None:
            report = None
            while report is None and not self.stopping:
                report = self._read_ready(block=False)
                if report is None:
                    time.sleep(POLL_S)
                    if any(c.process is not None and c.process.poll() in FATAL_EXIT_CODES
                           for c in self.api):
                        return self._api_startup_failure()
            if self.stopping:
                return 0
            if not report.get("ok"):
                logger.error("the engine could not start: %s", report.get("error"))
                return int(report.get("exit_code", 1))
            self.startup["engine-core"] = {k: report[k] for k in ("phases", "memory", "events") if k in report}
        while not self.stopping:
            time.sleep(POLL_S)
            if not self._watch():
                return self.exit_code
        return 0

    def _api_startup_failure(self) -> int:
        child = next(c for c in self.api if c.process is not None and c.process.poll() in FATAL_EXIT_CODES)
        code = child.process.returncode
        logger.error("%s could not start (exit %d); stopping", child.role, code)
        return code

    def _collect_startup(self) -> None:
        """Once every API server listens: log (and with ``--startup-report`` write) where the
        start went, per process — the cold start → HTTP ready breakdown."""
        for child in self.api:
            path = os.path.join(self.run_dir, API_STARTUP_FILE.format(role=child.role))
            if child.role not in self.startup and os.path.exists(path):
                try:
                    with open(path) as handle:
                        self.startup[child.role] = json.load(handle)
                except (OSError, ValueError):
                    return  # being written: read it next time
        if any(child.role not in self.startup for child in self.api):
            return
        if self.core is not None and "engine-core" not in self.startup:
            return
        self.phases.mark("until_http_ready")
        report = {"supervisor": {"phases": self.phases.as_dict(), "events": startup_events(self.phases.started)},
                  **self.startup}
        self.startup = None
        logger.info("ready %.2f s after start: %s", self.phases.total, json.dumps(report))
        path = getattr(self.args, "startup_report", None)
        if path:
            with open(path + ".tmp", "w") as handle:
                json.dump(report, handle, indent=1)
            os.replace(path + ".tmp", path)

    def _watch(self) -> bool:
        """Restart whatever died; False when a restart budget is spent."""
        if self.startup is not None:
            self._collect_startup()
        now = time.monotonic()
        core = self.core
        if core is not None:
            if core.process is None:
                if core.restart_at is not None and now >= core.restart_at:
                    core.restart_at = None
                    self._start_core()
            else:
                if core.ready_fd is not None:
                    report = self._read_ready(block=False)
                    if report is not None and report.get("ok"):
                        logger.info("engine core restarted (pid %d)", core.process.pid)
                code = core.process.poll()
                if code is not None:
                    if core.ready_fd is not None:
                        os.close(core.ready_fd)
                        core.ready_fd = None
                    if not self._schedule_restart(core, f"exited with code {code}"):
                        return False
                    self._write_table()
        for index, child in enumerate(self.api):
            if child.process is None:
                if child.restart_at is not None and now >= child.restart_at:
                    child.restart_at = None
                    self._start_api(index)
                continue
            code = child.process.poll()
            if code is not None:
                if code in FATAL_EXIT_CODES:  # a bad flag or a port in use: a restart cannot help
                    logger.error("%s exited with code %d (a start-up error); stopping", child.role, code)
                    self.exit_code = code
                    return False
                if not self._schedule_restart(child, f"exited with code {code}"):
                    return False
                self._write_table()
        return True

    def _stop_children(self) -> None:
        """API servers first (they drain their streams), then the engine core."""
        timeout = float(getattr(self.args, "shutdown_timeout", 30.0)) + 10.0
        _terminate([c.process for c in self.api if c.process is not None], timeout)
        if self.core is not None and self.core.process is not None:
            _terminate([self.core.process], 30.0)
        if self.sock is not None:
            self.sock.close()


def _plain(values: dict) -> dict:
    """The JSON-able part of an argparse namespace (drops e.g. the CLI's handler function)."""
    return {k: v for k, v in values.items() if isinstance(v, (str, int, float, bool, list, type(None)))}


def _terminate(processes: list[subprocess.Popen], timeout: float) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("pid %d did not stop within %.0f s; killing it", process.pid, timeout)
            process.kill()
            process.wait()
