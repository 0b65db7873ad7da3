"""The real ``smg`` router in front of SGLang-protocol workers, all on loopback.

Workers here run ``test_sglang_service.py`` as a script: the servicer over ``LoggingFakeEngine``,
which prints one line per generate and per abort, so a test can tell which worker served what
and that the router's Abort arrived. Every process is started in its own session and stopped
by pid (SIGTERM, then SIGKILL after a bounded wait).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sglang_pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sglang_grpc

SMG = shutil.which("smg") or str(Path(sys.executable).with_name("smg"))
WORKER_SCRIPT = Path(__file__).with_name("test_sglang_service.py")
START_TIMEOUT_S = 60.0

pytestmark = pytest.mark.skipif(not Path(SMG).exists(), reason="the smg router is not installed (pip install smg)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Process:
    """A subprocess in its own session whose output goes to ``log``."""

    name: str
    popen: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def check_alive(self) -> None:
        if self.popen.poll() is not None:
            raise AssertionError(f"{self.name} exited with {self.popen.returncode}:\n{self.output()[-4000:]}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=10)


def start_process(name: str, command: list[str], log_dir: Path) -> Process:
    log = log_dir / f"{name}.log"
    with log.open("wb") as sink:
        popen = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
    return Process(name, popen, log)


def wait_until(what: str, ready: Callable[[], bool], processes: list[Process],
               timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for process in processes:
            process.check_alive()
        try:
            if ready():
                return
        except (httpx.HTTPError, grpc.RpcError, OSError):
            pass
        time.sleep(0.2)
    logs = "\n".join(f"--- {p.name}\n{p.output()[-3000:]}" for p in processes)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{logs}")


def worker_healthy(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = sglang_grpc.SglangSchedulerStub(channel)
        return stub.HealthCheck(sglang_pb.HealthCheckRequest(), timeout=2).healthy


def worker_running(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = sglang_grpc.SglangSchedulerStub(channel)
        return stub.GetLoads(sglang_pb.GetLoadsRequest(), timeout=2).loads[0].num_running_reqs


def start_router(worker_ports: list[int], policy: str, log_dir: Path, processes: list[Process]) -> str:
    """``smg launch`` in front of the workers; returns its base URL once it can serve ``model``."""
    port = free_port()
    command = [SMG, "launch", "--host", "127.0.0.1", "--port", str(port),
               "--worker-urls", *[f"grpc://127.0.0.1:{p}" for p in worker_ports],
               "--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--shutdown-grace-period-secs", "1", "--log-level", "warn", "--disable-retries"]
    processes.append(start_process("router", command, log_dir))
    return f"http://127.0.0.1:{port}"


def router_ready(base_url: str, model: str, num_workers: int) -> bool:
    workers = httpx.get(f"{base_url}/workers", timeout=2).json()
    listed = workers.get("workers", workers) if isinstance(workers, dict) else workers
    healthy = [w for w in listed if w.get("is_healthy", w.get("healthy", True))]
    tokenized = httpx.post(f"{base_url}/v1/tokenize", json={"model": model, "prompt": "hello"}, timeout=2)
    return len(healthy) >= num_workers and tokenized.status_code == 200


@dataclass
class FakeCluster:
    base_url: str
    worker_ports: list[int]
    workers: list[Process]


@pytest.fixture(scope="module")
def fake_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeCluster]:
    """Two fake-engine workers (10 ms per token) behind one round-robin router."""
    log_dir = tmp_path_factory.mktemp("sglang-router")
    processes: list[Process] = []
    try:
        ports = [free_port(), free_port()]
        workers = [start_process(f"worker{i}", [sys.executable, str(WORKER_SCRIPT), str(port),
                                                str(log_dir / "model"), "0.01"], log_dir)
                   for i, port in enumerate(ports)]
        processes.extend(workers)
        for port in ports:
            wait_until(f"worker on port {port}", lambda port=port: worker_healthy(port), processes)
        base_url = start_router(ports, "round_robin", log_dir, processes)
        wait_until("the router to register both workers", lambda: router_ready(base_url, "tiny", 2), processes)
        yield FakeCluster(base_url, ports, workers)
    finally:
        for process in reversed(processes):
            process.stop()


def chat(base_url: str, content: str, **body: object) -> httpx.Response:
    payload = {"model": "tiny", "messages": [{"role": "user", "content": content}], **body}
    return httpx.post(f"{base_url}/v1/chat/completions", json=payload, timeout=30)


def test_chat_completion_through_the_router(fake_cluster):
    response = chat(fake_cluster.base_url, "hello world", max_tokens=3)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["message"]["content"] == "alpha beta gamma"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3


def test_streaming_chat_matches_the_non_streaming_text(fake_cluster):
    deltas, finish = [], None
    payload = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{fake_cluster.base_url}/v1/chat/completions", json=payload, timeout=30) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = httpx.Response(200, content=line[6:]).json()["choices"][0]
            deltas.append(choice["delta"].get("content") or "")
            finish = choice["finish_reason"] or finish
    whole = chat(fake_cluster.base_url, "hello", max_tokens=5).json()["choices"][0]["message"]["content"]
    assert "".join(deltas) == whole == "alpha beta gamma delta alpha"
    assert finish == "length"


def test_completions_with_a_stop_string(fake_cluster):
    response = httpx.post(f"{fake_cluster.base_url}/v1/completions", timeout=30,
                          json={"model": "tiny", "prompt": "hello world", "max_tokens": 10, "stop": ["gamma"]})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert (choice["text"].strip(), choice["finish_reason"]) == ("alpha beta", "stop")
    assert response.json()["usage"]["completion_tokens"] == 3  # the worker stopped at the stop string


def test_n_choices_through_the_router(fake_cluster):
    for stream in (False, True):
        payload = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "n": 2,
                   "stream": stream}
        if not stream:
            response = httpx.post(f"{fake_cluster.base_url}/v1/chat/completions", json=payload, timeout=30)
            assert response.status_code == 200, response.text
            choices = response.json()["choices"]
            texts = {c["index"]: c["message"]["content"] for c in choices}
        else:
            texts = {0: "", 1: ""}
            with httpx.stream("POST", f"{fake_cluster.base_url}/v1/chat/completions", json=payload,
                              timeout=30) as response:
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        for choice in httpx.Response(200, content=line[6:]).json()["choices"]:
                            texts[choice["index"]] += choice["delta"].get("content") or ""
        assert texts == {0: "alpha beta", 1: "alpha beta"}, (stream, texts)


def test_unsupported_request_is_a_clear_400(fake_cluster):
    schema = {"type": "object", "properties": {"a": {"type": "wat"}}}
    response = chat(fake_cluster.base_url, "hello", max_tokens=3,
                    response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert response.status_code == 400, response.text
    assert "json_schema" in response.text and "wat" in response.text
    assert chat(fake_cluster.base_url, "hello", max_tokens=1).status_code == 200  # workers still serve


def test_both_workers_receive_traffic(fake_cluster):
    before = [w.output().count("generate ") for w in fake_cluster.workers]
    for _ in range(4):
        assert chat(fake_cluster.base_url, "hello", max_tokens=1).status_code == 200
    served = [w.output().count("generate ") - b for w, b in zip(fake_cluster.workers, before, strict=True)]
    assert sum(served) == 4 and all(count >= 1 for count in served), served


def test_cache_aware_router_keeps_a_prompt_on_one_worker(fake_cluster, tmp_path):
    """A second router, cache_aware, over the same two workers: a repeated prompt keeps going to
    the worker that served it first (the router's token tree), a new prompt may go elsewhere."""
    processes: list[Process] = []
    try:
        base_url = start_router(fake_cluster.worker_ports, "cache_aware", tmp_path, processes)
        wait_until("the cache-aware router", lambda: router_ready(base_url, "tiny", 2), processes)
        prompt = "alpha beta gamma delta epsilon zeta eta theta " * 4
        before = [w.output().count("generate ") for w in fake_cluster.workers]
        for _ in range(4):
            assert chat(base_url, prompt, max_tokens=1).status_code == 200
        served = [w.output().count("generate ") - b for w, b in zip(fake_cluster.workers, before, strict=True)]
        assert sorted(served) == [0, 4], served
    finally:
        for process in processes:
            process.stop()


def test_client_disconnect_aborts_the_request_in_the_worker(fake_cluster):
    payload = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1000,
               "stream": True}
    with httpx.stream("POST", f"{fake_cluster.base_url}/v1/chat/completions", json=payload, timeout=30) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
        busy = [port for port in fake_cluster.worker_ports if worker_running(port) == 1]
        assert len(busy) == 1
    # the client is gone: the router sends Abort and the engine request ends (fake KV freed)
    port = busy[0]
    worker = fake_cluster.workers[fake_cluster.worker_ports.index(port)]
    wait_until("the worker to drop the request", lambda: worker_running(port) == 0, [worker], timeout=10)
    wait_until("the router's Abort", lambda: "abort " in worker.output(), [worker], timeout=10)


def test_a_router_without_the_tokenizer_files_fetches_them_from_the_worker(tmp_path):
    """A router on another machine: the worker's tokenizer_path does not exist there, so the
    router asks the worker for the files (GetTokenizer) and serves chat with them."""
    processes: list[Process] = []
    try:
        port = free_port()
        processes.append(start_process("remote-worker", [sys.executable, str(WORKER_SCRIPT), str(port),
                                                         str(tmp_path / "model"), "0", "/nonexistent/models/tiny"],
                                       tmp_path))
        wait_until("the worker", lambda: worker_healthy(port), processes)
        base_url = start_router([port], "cache_aware", tmp_path, processes)
        wait_until("the router to load the tokenizer from the worker", lambda: router_ready(base_url, "tiny", 1),
                   processes)
        response = chat(base_url, "hello world", max_tokens=2)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == "alpha beta"
    finally:
        for process in reversed(processes):
            process.stop()


# --- real openinfer workers: `openinfer serve` on the demo model -----------------------------------

DEMO_NAME = "smollm2"


def engine_load(port: int):
    from openinfer.v1 import engine_pb2, engine_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return engine_pb2_grpc.EngineStub(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=2)


def last_sglang_request_time(port: int) -> float:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = sglang_grpc.SglangSchedulerStub(channel)
        return stub.GetServerInfo(sglang_pb.GetServerInfoRequest(), timeout=2).last_receive_timestamp


@dataclass
class OpeninferCluster:
    router_url: str
    http_urls: list[str]
    grpc_ports: list[int]


@pytest.fixture(scope="module")
def openinfer_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpeninferCluster]:
    """Two ``openinfer serve`` workers (demo model, CPU) behind one round-robin ``smg`` router."""
    from openinfer.demo import ensure_demo_model

    model_dir = ensure_demo_model(progress=False)
    log_dir = tmp_path_factory.mktemp("openinfer-router")
    openinfer = shutil.which("openinfer") or str(Path(sys.executable).with_name("openinfer"))
    processes: list[Process] = []
    try:
        http_ports, grpc_ports = [free_port(), free_port()], [free_port(), free_port()]
        for i, (http_port, grpc_port) in enumerate(zip(http_ports, grpc_ports, strict=True)):
            processes.append(start_process(f"openinfer{i}", [
                openinfer, "serve", "--model-path", str(model_dir), "--served-model-name", DEMO_NAME,
                "--device", "cpu", "--host", "127.0.0.1", "--port", str(http_port), "--grpc-port", str(grpc_port),
                "--max-model-len", "2048", "--shutdown-timeout", "2", "--log-level", "warning"], log_dir))
        for port in grpc_ports:
            wait_until(f"openinfer on gRPC port {port}", lambda port=port: worker_healthy(port), processes, 120)
        router_url = start_router(grpc_ports, "round_robin", log_dir, processes)
        wait_until("the router to register both workers", lambda: router_ready(router_url, DEMO_NAME, 2), processes)
        yield OpeninferCluster(router_url, [f"http://127.0.0.1:{p}" for p in http_ports], grpc_ports)
    finally:
        for process in reversed(processes):
            process.stop()


CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow
def test_greedy_chat_through_the_router_matches_openinfer_http(openinfer_cluster):
    body = {"model": DEMO_NAME, "messages": CAPITAL, "max_tokens": 12, "temperature": 0}
    direct = httpx.post(f"{openinfer_cluster.http_urls[0]}/v1/chat/completions", json=body, timeout=120)
    routed = httpx.post(f"{openinfer_cluster.router_url}/v1/chat/completions", json=body, timeout=120)
    assert direct.status_code == routed.status_code == 200, routed.text
    direct_choice, routed_choice = direct.json()["choices"][0], routed.json()["choices"][0]
    assert "Paris" in routed_choice["message"]["content"]
    assert routed_choice["message"]["content"] == direct_choice["message"]["content"]
    assert routed_choice["finish_reason"] == direct_choice["finish_reason"]
    assert routed.json()["usage"]["prompt_tokens"] == direct.json()["usage"]["prompt_tokens"]
    assert routed.json()["usage"]["completion_tokens"] == direct.json()["usage"]["completion_tokens"]


@pytest.mark.slow
def test_streaming_chat_through_the_router_matches_non_streaming(openinfer_cluster):
    """With the real ``openai`` client, as an application would talk to the router."""
    import openai

    client = openai.OpenAI(base_url=f"{openinfer_cluster.router_url}/v1", api_key="unused", timeout=120)
    whole = client.chat.completions.create(model=DEMO_NAME, messages=CAPITAL, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(model=DEMO_NAME, messages=CAPITAL, max_tokens=12, temperature=0,
                                            stream=True)
    deltas, finish = [], None
    for chunk in stream:
        if chunk.choices:
            deltas.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(deltas) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason


@pytest.mark.slow
def test_greedy_completions_through_the_router_match_openinfer_http(openinfer_cluster):
    body = {"model": DEMO_NAME, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    direct = httpx.post(f"{openinfer_cluster.http_urls[1]}/v1/completions", json=body, timeout=120)
    routed = httpx.post(f"{openinfer_cluster.router_url}/v1/completions", json=body, timeout=120)
    assert direct.status_code == routed.status_code == 200, routed.text
    assert routed.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]
    assert routed.json()["choices"][0]["finish_reason"] == direct.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow
def test_both_openinfer_workers_receive_router_traffic(openinfer_cluster):
    before = [last_sglang_request_time(port) for port in openinfer_cluster.grpc_ports]
    for _ in range(2):
        response = httpx.post(f"{openinfer_cluster.router_url}/v1/completions", timeout=120,
                              json={"model": DEMO_NAME, "prompt": "Hello", "max_tokens": 1})
        assert response.status_code == 200, response.text
    after = [last_sglang_request_time(port) for port in openinfer_cluster.grpc_ports]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)


@pytest.mark.slow
def test_disconnect_through_the_router_frees_kv_in_the_openinfer_worker(openinfer_cluster):
    body = {"model": DEMO_NAME, "messages": CAPITAL, "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{openinfer_cluster.router_url}/v1/chat/completions", json=body,
                      timeout=120) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(4):
            next(lines)
        busy = [port for port in openinfer_cluster.grpc_ports if engine_load(port).num_running == 1]
        assert len(busy) == 1 and engine_load(busy[0]).kv_blocks_used > 0
    # 1500 tokens would take minutes on the CPU: only the router's Abort ends the request this soon
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (engine_load(busy[0]).num_running or engine_load(busy[0]).kv_blocks_used):
        time.sleep(0.1)
    load = engine_load(busy[0])
    assert (load.num_running, load.num_waiting, load.kv_blocks_used) == (0, 0, 0)
