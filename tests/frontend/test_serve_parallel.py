"""``openinfer serve --tensor-parallel-size 2`` as a user runs it on the CPU: the flag reaches the
engine-core process, whose ranks run as threads with the fake communicator, and the served
greedy completions equal those of a single-rank server on the same checkpoint."""

from __future__ import annotations

import openai
import pytest
from test_serve import free_port, start, stop, wait_healthy
from tiny_checkpoints import write_tiny_qwen3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve-tp") / "tiny-qwen3"
    write_tiny_qwen3(path, max_position_embeddings=1024)
    return path


def greedy_texts(model_dir, *flags: str) -> list[str]:
    port = free_port()
    server = start("--model-path", str(model_dir), "--port", str(port), "--grpc-port", str(free_port()),
                   "--device", "cpu", "--num-kv-blocks", "64", "--shutdown-timeout", "1", *flags)
    try:
        wait_healthy(server, f"http://127.0.0.1:{port}")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        return [client.completions.create(model="tiny-qwen3", prompt=prompt, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text
                for prompt in ("hello world", "the quick brown fox")]
    finally:
        assert stop(server) == 0


def test_tensor_parallel_server_serves_the_same_greedy_text(model_dir):
    assert greedy_texts(model_dir, "--tensor-parallel-size", "2") == greedy_texts(model_dir)


def test_a_bad_layout_stops_the_server_with_the_flag_named(model_dir):
    server = start("--model-path", str(model_dir), "--port", str(free_port()), "--grpc-port", str(free_port()),
                   "--device", "cpu", "--tensor-parallel-size", "3")
    output, _ = server.communicate(timeout=120)
    assert server.returncode != 0
    assert "does not divide by --tensor-parallel-size 3" in output
