"""Issue 11's hardening on the multi-process server (``openinfer serve``: supervisor, engine core,
API servers), where the in-process tests of test_hardening.py do not reach: the API key reaches the
API servers through the environment only; a 10 MB body or a long tokenization in an API server
leaves its /health responsive; after a 500 (an engine failure, or an exception inside the API
server) the keep-alive connection serves the next request; the queue-wait timeout answers 503;
a gRPC port in use stops the whole server with exit 3 (no restart loop), with several API servers too.

The engine is the stub (``openinfer.engine_core.stub``: real scheduler and KV, no model math);
faults come from ``fault_injection``."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from fault_injection import API_FAULT_TEXT, ENGINE_FAULT_PROMPT, FACTORY_SPEC, write_sitecustomize
from test_hardening import _post_while_probing
from test_multiprocess import children
from test_serve import free_port, stop, wait_healthy
from tiny_checkpoints import write_tokenizer

from openinfer.engine_core.stub import write_stub_model
from openinfer.frontend.serve import API_KEY_ENV, STARTUP_FAILURE
from openinfer.v1 import engine_pb2 as pb
from openinfer.v1 import engine_pb2_grpc

KEY = "multiprocess-secret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_QUEUE_WAIT_S = 0.5


@pytest.fixture(scope="module")
def stub_model(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("stub")
    write_tokenizer(root / "tokenizer")
    # a context long enough that a prompt taking a second to tokenize is not refused by its length
    # first, while a 10 MB body is
    return write_stub_model(root / "model", root / "tokenizer", step_ms=4.0, max_model_len=200_000)


def _environment(site_dir: Path) -> dict[str, str]:
    """The server's environment: the API key (never on a command line) and the fault injection."""
    paths = [str(site_dir), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, API_KEY_ENV: KEY, "PYTHONPATH": os.pathsep.join(p for p in paths if p),
            "PYTHONUNBUFFERED": "1"}


def _serve(stub_model: Path, site_dir: Path, *args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "openinfer.cli", "serve", "--log-level", "warning", "--model-path",
               str(stub_model), "--engine-factory", FACTORY_SPEC, "--device", "cpu", *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_environment(site_dir))


@pytest.fixture(scope="module")
def server(stub_model, tmp_path_factory) -> Iterator[dict]:
    site_dir = write_sitecustomize(tmp_path_factory.mktemp("site"))
    http_port, grpc_port = free_port(), free_port()
    process = _serve(stub_model, site_dir, "--port", str(http_port), "--grpc-port", str(grpc_port),
                     "--num-kv-blocks", "400", "--max-num-seqs", "1", "--max-queue-wait", str(MAX_QUEUE_WAIT_S),
                     "--shutdown-timeout", "1")
    url = f"http://127.0.0.1:{http_port}"
    try:
        wait_healthy(process, url)
        yield {"process": process, "url": url, "site_dir": site_dir, "grpc": f"127.0.0.1:{grpc_port}"}
    finally:
        if process.poll() is None:
            assert stop(process) == 0


def _descendants(pid: int) -> dict[int, str]:
    found = {}
    for child, command in children(pid).items():
        found[child] = command
        found.update(_descendants(child))
    return found


def test_the_api_key_reaches_the_api_servers_through_the_environment_only(server):
    assert httpx.get(server["url"] + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(server["url"] + "/v1/models", headers=AUTH, timeout=10).status_code == 200
    processes = _descendants(server["process"].pid)
    assert any("openinfer.frontend.api_server" in command for command in processes.values())
    assert all(KEY not in command for command in processes.values()), processes


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_a_10_mb_body_in_an_api_server_leaves_its_health_responsive(server):
    body = {"messages": [{"role": "user", "content": "word " * 2_000_000}], "max_tokens": 1}
    response, latencies = _post_while_probing(server["url"], "/v1/chat/completions", body, headers=AUTH)
    error = _error(response, 400)
    assert error["param"] == "messages" and "characters" in error["message"]
    assert latencies and max(latencies) < 1.0, latencies


def test_a_long_tokenization_in_an_api_server_leaves_its_health_responsive(server):
    timings: dict[str, float] = {}
    response, latencies = _post_while_probing(server["url"], "/v1/completions",
                                              {"prompt": "Paris is the capital of France. " * 36_000,
                                               "max_tokens": 1}, timings, headers=AUTH)
    # the prompt is tokenized (about a second on an idle box), then refused: it cannot fit the 400-block KV pool
    assert response.status_code == 400, response.text
    assert len(latencies) >= 2 and max(latencies) < max(0.5, 0.3 * timings["request_s"]), (latencies, timings)


def _exchange(sock: socket.socket, body: dict) -> tuple[int, bytes, dict]:
    """POST /v1/completions on an open connection: (status, head, JSON body)."""
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(payload)).encode()
                 + b"\r\n\r\n" + payload)
    data = b""
    while b"\r\n\r\n" not in data:
        data += _receive(sock)
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    while len(rest) < length:
        rest += _receive(sock)
    return int(head.split()[1]), head, json.loads(rest)


def _receive(sock: socket.socket) -> bytes:
    chunk = sock.recv(65536)
    if not chunk:
        raise ConnectionError("the server closed the connection")
    return chunk


def test_after_500s_the_keep_alive_connection_serves_the_next_request(server):
    valid = {"prompt": "hello", "max_tokens": 2}
    with socket.create_connection(("127.0.0.1", int(server["url"].rsplit(":", 1)[1])), timeout=30) as sock:
        assert _exchange(sock, valid)[0] == 200
        # an engine failure: the engine core reports it, the API server answers 500
        status, head, body = _exchange(sock, {"prompt": list(ENGINE_FAULT_PROMPT), "max_tokens": 2})
        assert status == 500 and body["error"]["type"] == "server_error", body
        assert b"connection: close" not in head.lower()
        assert _exchange(sock, valid)[0] == 200
        # an exception no handler maps, raised inside the API server
        status, head, body = _exchange(sock, {"prompt": f"a {API_FAULT_TEXT}", "max_tokens": 2})
        assert status == 500 and body["error"]["code"] == "internal_error", body
        assert b"connection: close" not in head.lower()
        assert _exchange(sock, valid)[0] == 200
        # bad input is a 400 on the same connection, and it stays usable too
        status, _, body = _exchange(sock, {"prompt": "a\ud800b", "max_tokens": 2})
        assert status == 400 and "surrogate" in body["error"]["message"]
        assert _exchange(sock, valid)[0] == 200
    assert server["process"].poll() is None


def test_a_request_queued_past_the_wait_limit_is_503_with_retry_after(server):
    """--max-num-seqs 1: one long stream holds the only batch slot; the next request waits in the
    engine core's queue and is answered 503 once it waited --max-queue-wait."""
    long = {"prompt": "hold the slot", "max_tokens": 5000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server["url"], headers=AUTH, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=long) as stream:
            assert stream.status_code == 200
            events = (line for line in stream.iter_lines() if line.startswith("data:"))
            next(events), next(events)  # it is in its decode steps
            began = time.monotonic()
            response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            waited = time.monotonic() - began
        error = _error(response, 503)
        assert error["code"] == "queue_timeout" and int(response.headers["retry-after"]) >= 1
        assert MAX_QUEUE_WAIT_S <= waited < 10, waited
        # the aborted waiter and the closed stream free the slot: the server serves again
        deadline = time.monotonic() + 20
        while (ok := client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})).status_code != 200:
            assert time.monotonic() < deadline, ok.text
            time.sleep(0.2)


def test_a_non_streamed_request_whose_client_left_is_aborted(server):
    """--max-num-seqs 1 and --max-queue-wait: were the abandoned request (5000 tokens, 20 s of
    steps) still generating, the next request would wait past the limit and get a 503."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server["url"] + "/v1/completions", headers=AUTH, timeout=1.0,
                   json={"prompt": "nobody reads this", "max_tokens": 5000, "ignore_eos": True})
    began = time.monotonic()
    response = httpx.post(server["url"] + "/v1/completions", headers=AUTH, timeout=30,
                          json={"prompt": "hi", "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert time.monotonic() - began < 5
    metrics = httpx.get(server["url"] + "/metrics", timeout=10).text
    assert any(line.startswith("openinfer_request_aborted_total") and not line.endswith(" 0.0")
               for line in metrics.splitlines()), metrics


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty"])
def test_nan_sampling_through_the_engine_core_is_invalid_argument(server, field):
    """openinfer.v1.Engine on the API server: the engine core refuses NaN, the refusal crosses
    the process boundary as INVALID_ARGUMENT naming the field, and the server keeps serving."""
    sampling = pb.SamplingParams(temperature=1.0, top_p=1.0, repetition_penalty=1.0)
    setattr(sampling, field, float("nan"))
    metadata = (("authorization", f"Bearer {KEY}"),)
    with grpc.insecure_channel(server["grpc"]) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        request = pb.GenerateRequest(request_id=f"nan-{field}", prompt_token_ids=[300, 301], sampling=sampling,
                                     stop=pb.StopConditions(max_tokens=2))
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(request, metadata=metadata, timeout=30))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in refused.value.details()
        request.request_id = f"ok-{field}"
        request.sampling.CopyFrom(pb.SamplingParams(temperature=0.0))
        tokens = [t for e in stub.Generate(request, metadata=metadata, timeout=30) for t in e.tokens.ids]
        assert len(tokens) == 2


@pytest.mark.parametrize("layout", [["--api-server-count", "1"], ["--api-server-count", "2"], ["--single-process"]],
                         ids=["1-api-server", "2-api-servers", "single-process"])
def test_a_grpc_port_in_use_stops_the_server_with_exit_3(stub_model, tmp_path, layout):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        grpc_port = holder.getsockname()[1]
        process = _serve(stub_model, write_sitecustomize(tmp_path / "site"), "--port", str(free_port()),
                         "--grpc-port", str(grpc_port), "--num-kv-blocks", "400", *layout)
        try:
            output, _ = process.communicate(timeout=120)
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
    assert process.returncode == STARTUP_FAILURE, output
    assert "--grpc-port" in output and "Traceback" not in output
    assert "restarting" not in output  # a port in use is no crash to retry
