"""`openinfer serve` with no --model-path serves the demo model; the real `openai` client asks it
for the capital of France over HTTP (greedy) and the answer names Paris."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from tests.helpers.cli_server import cli_server  # noqa: E402


@pytest.fixture(scope="module")
def demo_server(demo_model_dir: Path, tmp_path_factory) -> Iterator[str]:
    """The CLI exactly as a user runs it; the cache the fixture filled is the one it reads."""
    log = tmp_path_factory.mktemp("demo") / "server.log"
    with cli_server(demo_model_dir.parent, ["--num-kv-blocks", "256", "--log-level", "warning"], log,
                    _lists_models, poll_s=0.5) as url:
        yield url + "/v1"


def _lists_models(url: str) -> bool:
    try:
        openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0).models.list()
        return True
    except openai.APIConnectionError:
        return False


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
