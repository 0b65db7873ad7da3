"""The HTTP server over the real engine (a tiny random Qwen3 on the NumPy backend), driven by
the real ``openai`` client; and the same HTTP app in front of that engine through gRPC."""

from __future__ import annotations

import asyncio
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from conftest import LiveServer, LoopThread, wait_until
from tiny_checkpoints import write_tiny_qwen3

import openinfer
from openinfer.frontend.grpc import GrpcEngineClient, start_grpc_server
from openinfer.frontend.http import create_app
from openinfer.tokenizer import Tokenizer

MODEL = "tiny-qwen3"
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("models") / MODEL
    write_tiny_qwen3(directory, max_position_embeddings=MAX_MODEL_LEN)
    return directory


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = openinfer.create_engine(str(model_dir), device="cpu", num_kv_blocks=160, max_num_seqs=8)
    yield engine
    asyncio.run(engine.close())


@pytest.fixture(scope="module")
def tokenizer(engine) -> Tokenizer:
    return Tokenizer.from_dir(engine.info().tokenizer_path)


@pytest.fixture(scope="module")
def server(engine, tokenizer):
    with LiveServer(create_app(engine, tokenizer, MODEL)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def remote_client(engine, tokenizer):
    """HTTP → GrpcEngineClient → gRPC server → the same engine."""
    with LoopThread() as loop_thread:
        grpc_server = loop_thread.run(start_grpc_server(engine, "127.0.0.1", 0))
        remote = GrpcEngineClient(f"grpc://127.0.0.1:{grpc_server.port}")
        with LiveServer(create_app(remote, Tokenizer.from_dir(remote.info().tokenizer_path), MODEL)) as live:
            yield openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        loop_thread.run(grpc_server.stop(0.5))


CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour. 🙂"}]


def test_completion_stream_equals_non_stream_and_usage(client, tokenizer):
    prompt = "The quick brown fox"
    for sampling in ({"temperature": 0}, {"temperature": 0.9, "seed": 7, "top_p": 0.9}):
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                          extra_body={"ignore_eos": True}, **sampling)
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}, **sampling))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
        assert whole.usage.prompt_tokens == len(tokenizer.encode(prompt)) == chunks[-1].usage.prompt_tokens
        assert whole.usage.completion_tokens == 24 == chunks[-1].usage.completion_tokens
        assert whole.choices[0].finish_reason == "length"


def test_chat_stream_equals_non_stream(client):
    kwargs = {"messages": CHAT, "max_tokens": 20, "temperature": 0.8, "seed": 1}
    whole = client.chat.completions.create(model=MODEL, **kwargs)
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(model=MODEL, stream=True, **kwargs) if c.choices)
    assert streamed == whole.choices[0].message.content
    assert whole.usage.completion_tokens <= 20


def test_seed_reproducible_and_n2_distinct(client):
    kwargs = {"messages": CHAT, "max_tokens": 16, "temperature": 1.0, "seed": 1234, "n": 2}
    first = client.chat.completions.create(model=MODEL, **kwargs)
    second = client.chat.completions.create(model=MODEL, **kwargs)
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in second.choices]
    assert [c.index for c in first.choices] == [0, 1] and texts[0] != texts[1]


def test_logprobs(client):
    completion = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=5, temperature=0,
                                           logprobs=3, echo=True, extra_body={"ignore_eos": True})
    logprobs = completion.choices[0].logprobs
    assert logprobs.token_logprobs[0] is None
    assert all(v <= 0 for v in logprobs.token_logprobs[1:])
    assert all(len(top) >= 3 for top in logprobs.top_logprobs[1:])
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=2)
    for entry in chat.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy picks the top token


def test_stop_string_cuts_the_greedy_text(client):
    kwargs = {"prompt": "one two three", "max_tokens": 40, "temperature": 0, "extra_body": {"ignore_eos": True}}
    text = client.completions.create(model=MODEL, **kwargs).choices[0].text
    stop = next(text[i:i + 2] for i in range(4, len(text) - 2) if text[i:i + 2].strip()
                and "\ufffd" not in text[i:i + 2])
    cut = client.completions.create(model=MODEL, stop=[stop], **kwargs)
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model=MODEL, stop=[stop], stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in streamed) == text[:text.index(stop)]


def test_http_through_grpc_gives_the_same_tokens(client, remote_client):
    for kwargs in ({"temperature": 0}, {"temperature": 1.0, "seed": 99}):
        local = client.completions.create(model=MODEL, prompt="Paris is", max_tokens=12, logprobs=1,
                                          extra_body={"ignore_eos": True}, **kwargs).choices[0]
        remote = remote_client.completions.create(model=MODEL, prompt="Paris is", max_tokens=12, logprobs=1,
                                                  extra_body={"ignore_eos": True}, **kwargs).choices[0]
        assert remote.logprobs.tokens == local.logprobs.tokens and remote.text == local.text
    local_chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    remote_chat = remote_client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    assert remote_chat.choices[0].message.content == local_chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        remote_client.completions.create(model=MODEL, prompt="x", max_tokens=10**6)


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_disconnect_returns_every_kv_block(server, engine):
    aborted = 'openinfer_request_aborted_total{model_name="tiny-qwen3"}'  # an abort is not a success
    with httpx.Client(base_url=server.url) as http:
        before = _metric(http.get("/metrics").text, aborted)
        body = {"prompt": "a long story", "max_tokens": MAX_MODEL_LEN - 16, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            assert engine.load().kv_blocks_used > 0
        assert wait_until(lambda: engine.load().kv_blocks_used == 0 and engine.load().num_running == 0)
        assert _metric(http.get("/metrics").text, aborted) == before + 1
        # the pool is whole again: a request needing most of it still runs
        ok = http.post("/v1/completions", json={"prompt": "again", "max_tokens": 4, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


def test_repeated_prompt_reports_cached_tokens(client):
    prompt = "The quick brown fox jumps over the lazy dog. " * 4  # several full KV blocks
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 and cached % 16 == 0 and cached < second.usage.prompt_tokens
    assert second.choices[0].text == first.choices[0].text


def test_concurrent_requests_match_sequential_ones(client):
    prompts = ["one two three", "Hello world!", "def main():", "naïve café 你好"]

    def complete(prompt: str) -> str:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    sequential = [complete(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(complete, prompts)) == sequential
