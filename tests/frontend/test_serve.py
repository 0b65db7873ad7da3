"""``openinfer serve`` as a user runs it: a local engine process, a second process serving HTTP
in front of it with ``--engine grpc://``, API keys on both, and clean exits on SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import httpx
import openai
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from tiny_checkpoints import write_tiny_qwen3

from openinfer.frontend import serve

KEY = "serve-key"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(*args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "openinfer.cli", "serve", "--log-level", "warning", *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def wait_healthy(process: subprocess.Popen, url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"server exited with {process.returncode}:\n{process.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("server did not become healthy")


def stop(process: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
    process.send_signal(sig)
    try:
        return process.wait(timeout)
    finally:
        if process.poll() is None:
            process.kill()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("serve") / "tiny-qwen3"
    write_tiny_qwen3(model_dir, max_position_embeddings=4096)
    http_port, grpc_port, remote_port = free_port(), free_port(), free_port()
    local = start("--model-path", str(model_dir), "--port", str(http_port), "--grpc-port", str(grpc_port),
                  "--device", "cpu", "--num-kv-blocks", "300", "--api-key", KEY, "--shutdown-timeout", "1")
    remote = start("--engine", f"grpc://127.0.0.1:{grpc_port}", "--port", str(remote_port), "--api-key", KEY)
    try:
        wait_healthy(local, f"http://127.0.0.1:{http_port}")
        wait_healthy(remote, f"http://127.0.0.1:{remote_port}")
        yield {"local": local, "remote": remote, "http": f"http://127.0.0.1:{http_port}",
               "remote_http": f"http://127.0.0.1:{remote_port}", "grpc": f"127.0.0.1:{grpc_port}"}
    finally:
        for process in (remote, local):
            if process.poll() is None:
                process.kill()


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)


def test_remote_engine_gives_the_same_tokens_as_local(servers):
    local, remote = openai_client(servers["http"]), openai_client(servers["remote_http"])
    assert [m.id for m in remote.models.list().data] == ["tiny-qwen3"] == [m.id for m in local.models.list().data]
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 5}):
        kwargs = {"model": "tiny-qwen3", "prompt": "hello world", "max_tokens": 10, "logprobs": 0,
                  "extra_body": {"ignore_eos": True}, **sampling}
        a, b = local.completions.create(**kwargs).choices[0], remote.completions.create(**kwargs).choices[0]
        assert a.logprobs.tokens == b.logprobs.tokens and a.text == b.text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=servers["remote_http"] + "/v1", api_key="wrong", max_retries=0).models.list()


def test_grpc_port_serves_engine_and_sglang_services_behind_the_key(servers):
    with grpc.insecure_channel(servers["grpc"]) as channel:
        with pytest.raises(grpc.RpcError) as info:
            ProtoReflectionDescriptorDatabase(channel).get_services()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    keyed = grpc.intercept_channel(grpc.insecure_channel(servers["grpc"]), _KeyInterceptor())
    services = set(ProtoReflectionDescriptorDatabase(keyed).get_services())
    assert {"openinfer.v1.Engine", "grpc.health.v1.Health", "sglang.grpc.scheduler.SglangScheduler"} <= services


class _KeyInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def _details(self, details):
        return _Details(details, [*(details.metadata or ()), ("authorization", f"Bearer {KEY}")])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


class _Details(grpc.ClientCallDetails):
    def __init__(self, base, metadata):
        self.method, self.timeout, self.credentials = base.method, base.timeout, base.credentials
        self.wait_for_ready, self.compression = base.wait_for_ready, base.compression
        self.metadata = metadata


def test_sigterm_with_a_request_in_flight_exits_zero(servers):
    """Last in this module: stops both servers. The in-flight stream gets --shutdown-timeout (1 s),
    then it is cancelled and aborted; the engine process exits 0, then the front process (which
    answers 503 while its engine is gone) exits 0 on SIGINT."""
    received = []

    def stream_forever() -> None:
        try:
            with httpx.Client(base_url=servers["http"], headers={"Authorization": f"Bearer {KEY}"},
                              timeout=30) as http, http.stream(
                    "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 4000, "stream": True,
                                                     "ignore_eos": True, "temperature": 0}) as response:
                for line in response.iter_lines():
                    received.append(line)
        except httpx.HTTPError:
            pass

    reader = threading.Thread(target=stream_forever, daemon=True)
    reader.start()
    deadline = time.monotonic() + 20
    while not received and time.monotonic() < deadline:
        time.sleep(0.05)
    assert received, "the stream never started"
    assert stop(servers["local"], signal.SIGTERM) == 0
    reader.join(10)
    assert not reader.is_alive()
    # the front process outlives its engine: unhealthy and 503, but still answering
    with httpx.Client(base_url=servers["remote_http"], headers={"Authorization": f"Bearer {KEY}"}) as http:
        assert http.get("/health").status_code == 503
        response = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert response.status_code == 503 and "UNAVAILABLE" in response.json()["error"]["message"]
    assert stop(servers["remote"], signal.SIGINT) == 0


def test_engine_flags_are_forwarded_only_when_given():
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--model-path", "m", "--device", "cpu", "--max-model-len", "256",
                              "--no-prefix-cache", "--cuda-graph", "false", "--max-queue", "7",
                              "--gpu-memory-utilization", "0.5", "--served-model-name", "x"])
    assert serve.engine_options(args) == {"device": "cpu", "max_model_len": 256, "enable_prefix_cache": False,
                                          "cuda_graph": False, "max_queue": 7, "gpu_memory_utilization": 0.5,
                                          "served_model_name": "x"}
    defaults = parser.parse_args([])
    assert serve.engine_options(defaults) == {}
    assert (defaults.host, defaults.port, defaults.grpc_port) == ("127.0.0.1", 8000, 50051)
    with pytest.raises(SystemExit):
        parser.parse_args(["--cuda-graph", "maybe"])
