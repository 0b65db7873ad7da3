"""The multi-process server: one engine-core message per step, and faults.

A stub engine (``openinfer.engine_core.stub``: real scheduler/KV/engine, no model math) keeps
these fast. ``kill -9`` of the engine core mid-stream must end open HTTP and gRPC streams with an
error, flip /health and gRPC health to NOT_SERVING within 1 s, restart the core and serve again;
``kill -9`` of an API server must get it restarted.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_serve import free_port, start, stop, wait_healthy
from tiny_checkpoints import write_tokenizer

from openinfer.engine_core.client import EngineCoreClient
from openinfer.engine_core.step_log import STEP_LOG_ENV, summarize_steps
from openinfer.engine_core.stub import FACTORY_SPEC, write_stub_model
from openinfer.v1 import engine_pb2 as pb
from openinfer.v1 import engine_pb2_grpc


@pytest.fixture(scope="module")
def stub_model(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("stub")
    write_tokenizer(root / "tokenizer")
    return write_stub_model(root / "model", root / "tokenizer", step_ms=4.0)


def children(pid: int) -> dict[int, str]:
    """pid → command line of the direct children of ``pid`` (Linux /proc)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                found[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
    return found


def child_pid(pid: int, marker: str, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child, command in children(pid).items():
            if marker in command:
                return child
        time.sleep(0.05)
    raise AssertionError(f"no child of {pid} runs {marker!r}")


async def test_the_core_sends_one_message_per_step_not_per_token(stub_model, tmp_path):
    read_fd, write_fd = os.pipe()
    core = subprocess.Popen([sys.executable, "-m", "openinfer.engine_core", "--run-dir", str(tmp_path),
                             "--model-path", str(stub_model), "--engine-factory", FACTORY_SPEC,
                             "--ready-fd", str(write_fd), "--options-json", json.dumps({"num_kv_blocks": 200}),
                             "--log-level", "warning"], pass_fds=(write_fd,))
    os.close(write_fd)
    try:
        with os.fdopen(read_fd) as pipe:
            assert json.loads(pipe.readline())["ok"]
        client = EngineCoreClient(str(tmp_path))
        await client.connect(30)
        num_requests, num_tokens = 8, 24

        async def one(i: int) -> int:
            request = pb.GenerateRequest(request_id=f"r{i}", prompt_token_ids=[300 + i, 301, 302],
                                         stop=pb.StopConditions(max_tokens=num_tokens, ignore_eos=True))
            got = 0
            async for event in client.generate(request):
                got += len(event.tokens.ids)
            return got

        assert await asyncio.gather(*(one(i) for i in range(num_requests))) == [num_tokens] * num_requests
        # every step carries all running requests' tokens in one message: 8 requests × 24 tokens
        # arrive in about 24 step messages (+ the prefill and finish steps), not 192
        assert client.num_step_messages <= num_tokens + 4
        assert client.num_token_entries >= num_requests * num_tokens
        await client.close()
    finally:
        core.terminate()
        assert core.wait(20) == 0


@pytest.fixture(scope="module")
def server(stub_model):
    http_port, grpc_port = free_port(), free_port()
    process = start("--model-path", str(stub_model), "--engine-factory", FACTORY_SPEC, "--port", str(http_port),
                    "--grpc-port", str(grpc_port), "--device", "cpu", "--num-kv-blocks", "400",
                    "--shutdown-timeout", "1")
    try:
        wait_healthy(process, f"http://127.0.0.1:{http_port}")
        yield {"process": process, "http": f"http://127.0.0.1:{http_port}", "grpc": f"127.0.0.1:{grpc_port}"}
    finally:
        if process.poll() is None:
            assert stop(process) == 0


def _http_health(base: str) -> int | None:
    """/health's status code, or None when the probe timed out."""
    try:
        return httpx.get(base + "/health", timeout=2).status_code
    except httpx.TimeoutException:
        return None


def _grpc_serving(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1).status
        except grpc.RpcError:
            return -1


def test_killing_an_api_server_restarts_it(server):
    supervisor = server["process"].pid
    old = child_pid(supervisor, "openinfer.frontend.api_server")
    os.kill(old, signal.SIGKILL)
    new = old
    deadline = time.monotonic() + 30
    while new == old and time.monotonic() < deadline:
        try:
            new = child_pid(supervisor, "openinfer.frontend.api_server", timeout=1)
        except AssertionError:
            pass
    assert new != old
    wait_healthy(server["process"], server["http"])
    response = httpx.post(server["http"] + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3


def test_killing_the_engine_core_mid_stream_fails_streams_flips_health_and_recovers(server):
    supervisor = server["process"].pid
    core = child_pid(supervisor, "openinfer.engine_core")
    http_lines: list[str] = []
    grpc_events: list[pb.TokenEvent] = []
    started = threading.Event()

    def http_stream() -> None:
        with httpx.stream("POST", server["http"] + "/v1/completions", timeout=30,
                          json={"prompt": "x", "max_tokens": 3000, "stream": True, "ignore_eos": True}) as response:
            for line in response.iter_lines():
                if line:
                    http_lines.append(line)
                    started.set()

    def grpc_stream() -> None:
        with grpc.insecure_channel(server["grpc"]) as channel:
            request = pb.GenerateRequest(request_id="grpc-victim", prompt_token_ids=[300, 301],
                                         stop=pb.StopConditions(max_tokens=3000, ignore_eos=True))
            for event in engine_pb2_grpc.EngineStub(channel).Generate(request, timeout=30):
                grpc_events.append(event)

    readers = [threading.Thread(target=http_stream), threading.Thread(target=grpc_stream)]
    for reader in readers:
        reader.start()
    assert started.wait(20)
    deadline = time.monotonic() + 20
    while not any(e.HasField("tokens") for e in grpc_events) and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(core, signal.SIGKILL)
    killed = time.monotonic()
    # health turns NOT_SERVING on HTTP and gRPC (about at once; the bound allows for a loaded CI box, where a probe
    # itself may time out while the server fails the open streams)
    while _http_health(server["http"]) in (200, None):
        assert time.monotonic() - killed < 10, "/health still 200 ten seconds after the core died"
        time.sleep(0.02)
    while _grpc_serving(server["grpc"]) == health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() - killed < 10, "gRPC health still SERVING ten seconds after the core died"
        time.sleep(0.02)
    for reader in readers:
        reader.join(10)
        assert not reader.is_alive(), "a stream hangs after the engine core died"
    # the open streams ended with an error, not silently
    assert http_lines[-1] == "data: [DONE]"
    error = json.loads(http_lines[-2].removeprefix("data: "))["error"]
    assert "engine core process died" in error["message"]
    assert grpc_events[-1].HasField("error")
    assert grpc_events[-1].error.code == pb.ERROR_CODE_UNAVAILABLE
    # the supervisor restarts the core; health comes back and new requests are served
    assert child_pid(supervisor, "openinfer.engine_core", timeout=30) != core
    wait_healthy(server["process"], server["http"], timeout=60)
    deadline = time.monotonic() + 10
    while _grpc_serving(server["grpc"]) != health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    response = httpx.post(server["http"] + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=30)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4


def test_metrics_report_the_memory_of_every_process(server):
    text = httpx.get(server["http"] + "/metrics", timeout=10).text
    roles = {line.split('process="')[1].split('"')[0] for line in text.splitlines()
             if line.startswith("openinfer_process_resident_memory_bytes{")}
    assert {"supervisor", "engine-core", "api-server-0"} <= roles


def test_the_startup_report_breaks_every_process_start_into_phases(stub_model, tmp_path):
    http_port, report = free_port(), tmp_path / "startup.json"
    process = start("--model-path", str(stub_model), "--engine-factory", FACTORY_SPEC, "--port", str(http_port),
                    "--grpc-port", "0", "--device", "cpu", "--num-kv-blocks", "400", "--shutdown-timeout", "1",
                    "--api-server-count", "2", "--startup-report", str(report))
    try:
        wait_healthy(process, f"http://127.0.0.1:{http_port}")
        deadline = time.monotonic() + 20
        while not report.exists():
            assert time.monotonic() < deadline, "no start-up report"
            time.sleep(0.05)
        entries = json.loads(report.read_text())
        phases = {role: entry["phases"] for role, entry in entries.items()}
    finally:
        assert stop(process) == 0
    assert set(phases) == {"supervisor", "engine-core", "api-server-0", "api-server-1"}
    # each process's events: seconds after its start, in the order they happened
    events = {role: entry["events"] for role, entry in entries.items()}
    assert ["imports_done", "engine_build_started", "ready"] == [
        name for name in events["engine-core"] if name in ("imports_done", "engine_build_started", "ready")]
    assert {"core_spawned"} <= set(events["supervisor"])
    assert {"imports_done", "engine_connected"} <= set(events["api-server-1"])
    # the app is built (with the tokenizer of the model directory) while the core loads, not after
    # (by order: the report keeps the events in the order they happened; their times are rounded to
    # 0.1 ms, so on a fast start the two may print equal)
    api_events = list(events["api-server-0"])
    assert api_events.index("app_built") < api_events.index("engine_connected")
    for role, times in events.items():
        assert list(times.values()) == sorted(times.values()) and min(times.values()) >= 0, role
    assert {"spawn_and_imports", "model_load", "kv_planning", "transport"} <= set(
        phases["engine-core"])
    assert {"spawn_and_imports", "wait_for_engine", "tokenizer_and_app", "http_listening"} <= set(phases["api-server-1"])
    for role, parts in phases.items():
        assert all(seconds >= 0 for seconds in parts.values()), role
        assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total"), abs=0.01), role
    # the API servers started while the core loaded: each waited for it, none waited longer than the supervisor ran
    assert phases["supervisor"]["total"] >= phases["api-server-0"]["total"] - 0.05


def test_the_engine_core_writes_its_step_log_on_shutdown(stub_model, tmp_path, monkeypatch):
    http_port, log_path = free_port(), tmp_path / "steps.json"
    monkeypatch.setenv(STEP_LOG_ENV, str(log_path))
    process = start("--model-path", str(stub_model), "--engine-factory", FACTORY_SPEC, "--port", str(http_port),
                    "--grpc-port", "0", "--device", "cpu", "--num-kv-blocks", "400", "--shutdown-timeout", "1")
    try:
        url = f"http://127.0.0.1:{http_port}"
        wait_healthy(process, url)
        began = time.time()
        for _ in range(2):
            reply = httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True},
                               timeout=30)
            assert reply.status_code == 200
        ended = time.time()
    finally:
        assert stop(process) == 0
    deadline = time.monotonic() + 20
    while not log_path.exists():
        assert time.monotonic() < deadline, "no step log"
        time.sleep(0.05)
    log = json.loads(log_path.read_text())
    summary = summarize_steps(log, began, ended)
    # each request: one prompt step (its first token), then three single-token decode steps
    assert summary["mixed"]["tokens"] == 6 and summary["decode"]["tokens"] == 6
    assert summary["num_steps"] == summary["mixed"]["num_steps"] + summary["decode"]["num_steps"]
