"""The real ``smg`` router in gRPC mode in front of two openinfer workers speaking smg's
vLLM-engine protocol (``agent_worker.py``: a tiny random Qwen3 behind a Qwen3-like tokenizer),
serving chat with tools and reasoning and ``/v1/responses``; every output is compared with
openinfer's own HTTP server on the same model (greedy, so the same tokens)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from agent_checkpoints import write_family_model
from conftest import LiveServer
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc
from test_sglang_router import SMG, Process, free_port, router_ready, start_process, wait_until

import openinfer
from openinfer.frontend.http import create_app
from openinfer.tokenizer import Tokenizer

WORKER_SCRIPT = Path(__file__).with_name("agent_worker.py")
MODEL = "tiny"
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer",
                                                                                          "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
NATIVE_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}\n</tool_call>'
THOUGHT = r"<think>[a-z]{3,8}</think>\n\n[a-z ]{2,12}"

pytestmark = pytest.mark.skipif(not Path(SMG).exists(), reason="the smg router is not installed (pip install smg)")


def worker_healthy(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return vllm_grpc.VllmEngineStub(channel).HealthCheck(vllm_pb.HealthCheckRequest(), timeout=2).healthy


def start_router(ports: list[int], log_dir: Path, processes: list[Process], *parser_args: str) -> str:
    port = free_port()
    command = [SMG, "launch", "--host", "127.0.0.1", "--port", str(port),
               "--worker-urls", *[f"grpc://127.0.0.1:{p}" for p in ports], "--policy", "round_robin",
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--shutdown-grace-period-secs", "1", "--log-level", "warn", "--disable-retries", *parser_args]
    processes.append(start_process(f"router{len(processes)}", command, log_dir))
    return f"http://127.0.0.1:{port}"


@dataclass
class Cluster:
    router: str  # tool parser qwen, reasoning parser qwen3
    plain_router: str  # no reasoning parser (passthrough): the Responses API's text as generated
    ours: str  # openinfer's own HTTP server on the same model


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    log_dir = tmp_path_factory.mktemp("vllm-router")
    model_dir = write_family_model(log_dir / "model", "qwen3")
    processes: list[Process] = []
    engine = openinfer.create_engine(str(model_dir), device="cpu", num_kv_blocks=256, max_num_seqs=8)
    try:
        ports = [free_port(), free_port()]
        for i, port in enumerate(ports):
            processes.append(start_process(f"worker{i}", [sys.executable, str(WORKER_SCRIPT), str(port),
                                                          str(model_dir)], log_dir))
        for port in ports:
            wait_until(f"worker on port {port}", lambda port=port: worker_healthy(port), processes)
        router = start_router(ports, log_dir, processes, "--tool-call-parser", "qwen", "--reasoning-parser", "qwen3")
        plain = start_router(ports, log_dir, processes, "--tool-call-parser", "qwen",
                             "--reasoning-parser", "passthrough")
        for url in (router, plain):
            wait_until("the router to register both workers", lambda url=url: router_ready(url, MODEL, 2), processes)
        with LiveServer(create_app(engine, Tokenizer.from_dir(model_dir), MODEL)) as live:
            yield Cluster(router, plain, live.url)
    finally:
        for process in reversed(processes):
            process.stop()
        asyncio.run(engine.close())


def post(base_url: str, path: str, body: dict) -> dict:
    response = httpx.post(f"{base_url}{path}", json={"model": MODEL, **body}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def message_of(response: dict) -> dict:
    message = response["choices"][0]["message"]
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []]
    return {"content": message.get("content") or None, "reasoning": message.get("reasoning_content") or None,
            "calls": calls, "finish_reason": response["choices"][0]["finish_reason"]}


def test_named_tool_choice_through_the_router_equals_ours(cluster):
    body = {"messages": USER, "tools": TOOLS, "temperature": 0, "max_tokens": 60,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "chat_template_kwargs": {"enable_thinking": False}}
    theirs = message_of(post(cluster.router, "/v1/chat/completions", body))
    ours = message_of(post(cluster.ours, "/v1/chat/completions", body))
    assert theirs["calls"] and theirs["calls"][0][0] == "get_weather"
    assert theirs["calls"] == ours["calls"]


def test_model_written_tool_calls_through_the_router_equal_ours(cluster):
    """tool_choice auto: the router's qwen parser and ours read the same generated <tool_call> block
    (a regex makes the random network write one; the router takes SGLang's ``regex`` field, our
    server vLLM's ``structured_outputs``)."""
    body = {"messages": USER, "tools": TOOLS, "temperature": 0, "max_tokens": 80,
            "chat_template_kwargs": {"enable_thinking": False}}
    theirs = message_of(post(cluster.router, "/v1/chat/completions", {**body, "regex": NATIVE_CALL}))
    ours = message_of(post(cluster.ours, "/v1/chat/completions",
                           {**body, "structured_outputs": {"regex": NATIVE_CALL}}))
    assert ours["calls"] and ours["calls"][0][0] == "get_weather"
    assert theirs["calls"] == ours["calls"]
    assert theirs["finish_reason"] == ours["finish_reason"] == "tool_calls"


def test_reasoning_through_the_router_equals_ours(cluster):
    body = {"messages": USER, "temperature": 0, "max_tokens": 40}
    theirs = message_of(post(cluster.router, "/v1/chat/completions", {**body, "regex": THOUGHT}))
    ours = message_of(post(cluster.ours, "/v1/chat/completions", {**body, "structured_outputs": {"regex": THOUGHT}}))
    assert ours["reasoning"] and ours["content"]
    assert (theirs["reasoning"], theirs["content"]) == (ours["reasoning"], ours["content"])


def test_sampling_options_through_the_router_equal_ours(cluster):
    """n, seeds, logprobs and a json_schema constraint travel over vllm_engine.proto unchanged."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    body = {"messages": USER, "temperature": 1.0, "seed": 7, "n": 2, "max_tokens": 30, "logprobs": True,
            "top_logprobs": 2, "chat_template_kwargs": {"enable_thinking": False},
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    theirs = post(cluster.router, "/v1/chat/completions", body)
    ours = post(cluster.ours, "/v1/chat/completions", body)
    texts = sorted(c["message"]["content"] for c in ours["choices"])
    assert sorted(c["message"]["content"] for c in theirs["choices"]) == texts
    for text in texts:
        assert set(json.loads(text)) == {"ok", "n"}
    token_logprobs = sorted([t["logprob"] for t in c["logprobs"]["content"]] for c in ours["choices"])
    theirs_logprobs = sorted([t["logprob"] for t in c["logprobs"]["content"]] for c in theirs["choices"])
    for row_theirs, row_ours in zip(theirs_logprobs, token_logprobs, strict=True):
        # the router leaves out the end-of-sequence token's entry; ours lists it last
        assert len(row_ours) - 1 <= len(row_theirs) <= len(row_ours)
        assert row_theirs == pytest.approx(row_ours[:len(row_theirs)], abs=1e-4)


def test_responses_api_through_the_router_equals_ours(cluster):
    text = post(cluster.plain_router, "/v1/responses", {"input": USER[0]["content"], "temperature": 0,
                                                        "max_output_tokens": 12})
    ours = message_of(post(cluster.ours, "/v1/chat/completions", {"messages": USER, "temperature": 0,
                                                                   "max_tokens": 12}))
    [item] = [o for o in text["output"] if o["type"] == "message"]
    # cut by max tokens inside a character: the router drops the partial character, ours ends with U+FFFD
    assert "".join(part["text"] for part in item["content"]) == ours["content"].rstrip("\ufffd")
    call = post(cluster.plain_router, "/v1/responses", {
        "input": USER[0]["content"], "temperature": 0, "max_output_tokens": 60,
        "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}],
        "tool_choice": {"type": "function", "name": "get_weather"}})
    [function_call] = [o for o in call["output"] if o["type"] == "function_call"]
    ours_call = message_of(post(cluster.ours, "/v1/chat/completions", {
        "messages": USER, "tools": TOOLS, "temperature": 0, "max_tokens": 60,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}))
    assert [(function_call["name"], json.loads(function_call["arguments"]))] == ours_call["calls"]
