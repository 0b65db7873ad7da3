"""Start ``openinfer serve`` as a user runs it (a subprocess of the CLI) and wait until it answers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def cli_server(cache_dir: Path, args: list[str], log: Path, ready: Callable[[str], bool],
               startup_s: float = 180, poll_s: float = 0.3) -> Iterator[str]:
    """``openinfer serve --device cpu --port P --grpc-port 0 *args`` with ``OPENINFER_CACHE=cache_dir``,
    output to ``log``; yields ``http://127.0.0.1:P`` once ``ready(url)`` is true (failing the test
    with the server's output if it exits first or stays silent for ``startup_s``), stops it after."""
    port = free_port()
    env = {**os.environ, "OPENINFER_CACHE": str(cache_dir)}
    command = [sys.executable, "-m", "openinfer.cli", "serve", "--device", "cpu", "--port", str(port),
               "--grpc-port", "0", *args]
    with log.open("w") as output:
        server = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + startup_s
    try:
        while True:
            if server.poll() is not None:
                pytest.fail(f"openinfer serve exited with {server.returncode}:\n{log.read_text()}")
            if ready(url):
                break
            if time.monotonic() > deadline:
                pytest.fail(f"openinfer serve did not answer within {startup_s:.0f} s")
            time.sleep(poll_s)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
