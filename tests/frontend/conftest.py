"""Fixtures for frontend tests: tiny tokenizer/model directories and a live uvicorn server."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fakes import FakeEngine
from tiny_checkpoints import write_tokenizer

from openinfer.tokenizer import Tokenizer


class LiveServer:
    """Runs an ASGI app with uvicorn on 127.0.0.1 (ephemeral port) in a background thread."""

    def __init__(self, app):
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.port = 0

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class LoopThread:
    """An asyncio loop in a thread, for async servers (grpc.aio) used from sync tests."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> LoopThread:
        self.thread.start()
        return self

    def run(self, coroutine, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def plain_tokenizer_dir(tmp_path_factory) -> Path:
    """A tokenizer without any chat template."""
    directory = tmp_path_factory.mktemp("tokenizer_plain")
    write_tokenizer(directory, chat_template=None)
    return directory


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_dir)


@pytest.fixture(scope="module")
def engine(tokenizer, tokenizer_dir) -> FakeEngine:
    """The fake engine behind the HTTP tests (a module that needs another defines its own)."""
    return FakeEngine(tokenizer.vocab_size, tokenizer.eos_token_ids, max_model_len=256,
                      tokenizer_path=str(tokenizer_dir), sample_low=3)
