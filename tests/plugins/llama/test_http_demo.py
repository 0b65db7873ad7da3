"""`openinfer serve` with no --model-path serves the demo model; the real `openai` client asks it
for the capital of France over HTTP (greedy) and the answer names Paris."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def demo_server(demo_model_dir: Path) -> Iterator[str]:
    """The CLI exactly as a user runs it; the cache the fixture filled is the one it reads."""
    port = free_port()
    env = {**os.environ, "OPENINFER_CACHE": str(demo_model_dir.parent)}
    command = [sys.executable, "-m", "openinfer.cli", "serve", "--device", "cpu", "--port", str(port),
               "--grpc-port", "0", "--num-kv-blocks", "256", "--log-level", "warning"]
    server = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    deadline = time.monotonic() + 180
    try:
        while True:
            if server.poll() is not None:
                pytest.fail(f"openinfer serve exited with {server.returncode}:\n{server.stdout.read()}")
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                if time.monotonic() > deadline:
                    pytest.fail("openinfer serve did not answer within 180 s")
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def test_openai_chat_completion_says_paris(demo_server: str) -> None:
    client = openai.OpenAI(base_url=demo_server, api_key="unused")
    [model] = client.models.list().data
    assert model.id == "SmolLM2-135M-Instruct"
    reply = client.chat.completions.create(
        model=model.id, temperature=0, max_tokens=32,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    answer = reply.choices[0].message.content
    assert "Paris" in answer, answer
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens > 10 and 0 < reply.usage.completion_tokens < 32


def test_openai_streaming_chat_says_paris(demo_server: str) -> None:
    client = openai.OpenAI(base_url=demo_server, api_key="unused")
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", temperature=0, max_tokens=32, stream=True,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert "Paris" in text, text
