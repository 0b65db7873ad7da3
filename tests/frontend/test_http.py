"""The OpenAI HTTP server over the fake engine, driven by the real ``openai`` client on loopback."""

from __future__ import annotations

import json
import random

import httpx
import openai
import pytest
from conftest import LiveServer, wait_until
from tiny_checkpoints import byte_token_ids

from openinfer.frontend.http import create_app
from openinfer.tokenizer import Tokenizer

MODEL = "tiny-fake"
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def server(engine, tokenizer):
    with LiveServer(create_app(engine, tokenizer, MODEL, max_body_bytes=MAX_BODY)) as live:
        yield live


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url) as session:
        yield session


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def restore_engine(engine):
    saved = (engine.token_delay_s, engine.max_running, engine.healthy)
    yield engine
    engine.token_delay_s, engine.max_running, engine.healthy = saved


def greedy(client, **kwargs):
    return client.completions.create(model=MODEL, temperature=0, **kwargs)


# --- completions ---------------------------------------------------------------------------------


def test_completion_greedy_text_and_usage(client, tokenizer):
    prompt = "one two three four"
    ids = tokenizer.encode(prompt)
    response = greedy(client, prompt=prompt, max_tokens=2 * len(ids))
    choice = response.choices[0]
    assert choice.text == prompt + prompt  # the fake repeats the prompt
    assert choice.finish_reason == "length" and choice.index == 0
    assert response.model == MODEL and response.object == "text_completion"
    assert response.usage.prompt_tokens == len(ids)
    assert response.usage.completion_tokens == 2 * len(ids)
    assert response.usage.total_tokens == 3 * len(ids)
    assert response.usage.prompt_tokens_details.cached_tokens == 0


def test_completion_stop_string_is_cut_and_excluded(client):
    response = greedy(client, prompt="one two three four", max_tokens=40, stop=[" four", "zzz"])
    assert response.choices[0].text == "one two three"
    assert response.choices[0].finish_reason == "stop"
    streamed = greedy(client, prompt="one two three four", max_tokens=40, stop=" three", stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == "one two"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completion_stop_token_id_ends_with_stop(client, tokenizer):
    ids = tokenizer.encode("one two three four")
    response = greedy(client, prompt=ids, max_tokens=40, extra_body={"stop_token_ids": [ids[2]]})
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].text == tokenizer.decode(ids[:2])  # the stop token's text is not output
    assert response.usage.completion_tokens == 3


def test_completion_prompt_shapes_give_one_choice_per_prompt(client, tokenizer):
    ids = tokenizer.encode("hello world")
    for prompt in ("hello world", ["hello world"], ids, [ids]):
        response = greedy(client, prompt=prompt, max_tokens=len(ids))
        assert [c.text for c in response.choices] == ["hello world"]
    response = greedy(client, prompt=["one two", "hello world"], max_tokens=4, n=2)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert response.choices[0].text == response.choices[1].text != response.choices[2].text
    assert response.usage.prompt_tokens == len(tokenizer.encode("one two")) + len(ids)  # once per prompt


def test_completion_streamed_text_equals_non_streamed(client):
    kwargs = {"prompt": "emoji: 🙂 and 你好", "max_tokens": 60, "temperature": 1.0, "seed": 11}
    whole = client.completions.create(model=MODEL, **kwargs).choices[0].text
    chunks = list(client.completions.create(model=MODEL, stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert whole  # random ids over the byte-level vocabulary: text with split characters


def test_stream_never_splits_a_character(client, tokenizer):
    text = "é 你好 🙂!"
    ids = byte_token_ids(tokenizer, text)  # the fake repeats these byte tokens
    chunks = [c.choices[0].text for c in greedy(client, prompt=ids, max_tokens=2 * len(ids), stream=True)]
    assert "".join(chunks) == text * 2
    assert all("\ufffd" not in chunk for chunk in chunks)
    assert "🙂" in chunks  # four byte tokens, one delta


def test_completion_seed_reproducible_and_n_offsets_seeds(client, engine):
    kwargs = {"prompt": "one two", "max_tokens": 12, "temperature": 0.8, "n": 2, "seed": 5}
    first = client.completions.create(model=MODEL, **kwargs)
    second = client.completions.create(model=MODEL, **kwargs)
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.choices[0].text != first.choices[1].text
    seeds = [r.sampling.seed for r in engine.submitted[-2:]]
    ids = {r.request_id for r in engine.submitted[-4:]}
    assert seeds == [5, 6] and len(ids) == 4


def test_completion_logprobs_and_echo(client, tokenizer):
    prompt = "one two three"
    ids = tokenizer.encode(prompt)
    response = greedy(client, prompt=prompt, max_tokens=3, logprobs=2, echo=True)
    choice = response.choices[0]
    assert choice.text == prompt + tokenizer.decode(ids[:3])
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) + 3
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(isinstance(v, float) for v in logprobs.token_logprobs[1:])
    assert all(len(t) == 2 for t in logprobs.top_logprobs[1:])
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    assert "".join(logprobs.tokens) == choice.text


def test_completion_include_usage_chunk(client):
    chunks = list(greedy(client, prompt="one two", max_tokens=3, stream=True,
                         stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_continuous_usage_counts_tokens_per_chunk(client):
    """vLLM's ``continuous_usage_stats``: every chunk carries the usage so far, so a client can
    tell how many tokens each (possibly merged) chunk delivered."""
    chunks = list(greedy(client, prompt="one two", max_tokens=4, stream=True,
                         stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 4
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)


# --- chat ----------------------------------------------------------------------------------------


def test_chat_greedy_reply_and_usage(client, tokenizer):
    messages = [{"role": "user", "content": "héllo 你好"}]
    response = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40)
    choice = response.choices[0]
    # the fake repeats the templated prompt; it stops at <|im_end|> (eos), which is not output
    assert choice.message.content == "user\nhéllo 你好"
    assert choice.message.role == "assistant" and choice.finish_reason == "stop"
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == len(tokenizer.encode("<|im_start|>user\nhéllo 你好<|im_end|>"))


def test_chat_stream_equals_non_stream_with_n2_and_seed(client):
    kwargs = {"messages": [{"role": "user", "content": "tell me"}], "max_tokens": 30, "temperature": 1.0,
              "seed": 3, "n": 2}
    whole = client.chat.completions.create(model=MODEL, **kwargs)
    texts = {c.index: "" for c in whole.choices}
    roles = set()
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.delta.role:
                roles.add(choice.index)
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert roles == {0, 1} and texts[0] != texts[1]


def test_chat_logprobs_and_top_logprobs(client):
    response = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              temperature=0, max_tokens=4, logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.bytes == list(entry.token.encode())
        assert entry.top_logprobs[0].logprob == entry.logprob


def test_chat_stop_string_and_max_completion_tokens(client):
    messages = [{"role": "user", "content": "one two three"}]
    stopped = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40,
                                             stop=["three"])
    assert stopped.choices[0].message.content == "user\none two "
    assert stopped.choices[0].finish_reason == "stop"
    limited = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                             max_completion_tokens=2)
    assert limited.choices[0].finish_reason == "length" and limited.usage.completion_tokens == 2


def test_chat_include_usage_in_stream(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                 temperature=0, max_tokens=3, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 3 and chunks[-1].choices == []
    assert chunks[0].choices[0].delta.role == "assistant"


# --- other routes --------------------------------------------------------------------------------


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_health_follows_the_engine(http, restore_engine):
    assert http.get("/health").status_code == 200
    restore_engine.healthy = False
    response = http.get("/health")
    assert response.status_code == 503 and "unhealthy" in response.json()["error"]["message"]


def test_tokenize_and_detokenize(http, tokenizer):
    response = http.post("/tokenize", json={"model": MODEL, "prompt": "hello world"}).json()
    assert response["tokens"] == tokenizer.encode("hello world") and response["count"] == len(response["tokens"])
    assert response["max_model_len"] == 256
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert tokenizer.decode(chat["tokens"], skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    text = http.post("/detokenize", json={"tokens": response["tokens"]}).json()["prompt"]
    assert text == "hello world"


def test_metrics_count_requests_tokens_and_latency(http, client):
    greedy(client, prompt="one two", max_tokens=3)
    text = http.get("/metrics").text
    for name in ("openinfer_request_success_total{finished_reason=\"length\"",
                 "openinfer_prompt_tokens_total", "openinfer_generation_tokens_total",
                 "openinfer_time_to_first_token_seconds_bucket", "openinfer_inter_token_latency_seconds_bucket",
                 "openinfer_num_requests_running", "openinfer_num_requests_waiting",
                 "openinfer_kv_blocks_used", "openinfer_kv_blocks_total{model_name=\"tiny-fake\"} 256.0"):
        assert name in text, name


def test_queue_full_is_503_with_retry_after(http, restore_engine):
    restore_engine.max_running = 0
    response = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert response.status_code == 503
    assert response.headers["retry-after"] == "2"
    assert response.json()["error"]["code"] == "queue_full"


def test_n_choices_start_all_or_none(http, restore_engine):
    restore_engine.max_running = 1  # the second choice of n=2 is refused
    before = len(restore_engine.aborted)
    response = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 50, "n": 2})
    assert_openai_error(response, 503)
    assert wait_until(lambda: not restore_engine.running)
    assert len(restore_engine.aborted) == before + 1  # the choice that had started was aborted


def test_dead_engine_is_503(http, restore_engine):
    restore_engine.healthy = False
    assert_openai_error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}), 503)
    assert_openai_error(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}),
                        503)


@pytest.fixture
def failing_engine(engine):
    engine.fail_after = 2
    yield engine
    engine.fail_after = None


def test_engine_error_mid_request_is_a_json_error(http, failing_engine):
    response = http.post("/v1/completions", json={"prompt": "one two three", "max_tokens": 10})
    assert_openai_error(response, 500)
    assert "fake failure" in response.json()["error"]["message"]


def test_engine_error_mid_stream_is_reported_in_band(http, failing_engine):
    body = {"prompt": "one two three", "max_tokens": 10, "stream": True, "temperature": 0}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        frames = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    assert json.loads(frames[-2])["error"]["message"] == "the engine failed the request: fake failure"
    assert "".join(json.loads(f)["choices"][0]["text"] for f in frames[:-2]) == "one two"


# --- disconnects ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2])
def test_client_disconnect_aborts_and_frees_kv(server, restore_engine, n):
    engine = restore_engine
    engine.token_delay_s = 0.02
    before = len(engine.aborted)
    with httpx.Client(base_url=server.url) as session, session.stream(
            "POST", "/v1/completions", json={"prompt": "one two three", "max_tokens": 200, "n": n,
                                             "temperature": 0, "stream": True}) as response:
        lines = response.iter_lines()
        received = [line for line, _ in zip(lines, range(6), strict=False) if line.startswith("data:")]
        assert received and engine.blocks_used() > 0
    assert wait_until(lambda: engine.blocks_used() == 0 and not engine.running)
    assert len(engine.aborted) - before == n


# --- the bad-input table: one test per case, each a 4xx in OpenAI's shape --------------------------

BAD_INPUTS = {
    "missing prompt": ("/v1/completions", {"model": MODEL}, 400),
    "prompt wrong type": ("/v1/completions", {"prompt": 5}, 400),
    "empty prompt list": ("/v1/completions", {"prompt": []}, 400),
    "empty prompt string": ("/v1/completions", {"prompt": ""}, 400),
    "negative token id": ("/v1/completions", {"prompt": [1, -2]}, 400),
    "token id outside vocab": ("/v1/completions", {"prompt": [1, 10**6]}, 400),
    "unknown model": ("/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404),
    "negative temperature": ("/v1/completions", {"prompt": "x", "temperature": -1}, 400),
    "top_p zero": ("/v1/completions", {"prompt": "x", "top_p": 0}, 400),
    "top_k below -1": ("/v1/completions", {"prompt": "x", "top_k": -5}, 400),
    "min_p above one": ("/v1/completions", {"prompt": "x", "min_p": 1.5}, 400),
    "presence penalty out of range": ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400),
    "repetition penalty zero": ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400),
    "max_tokens zero": ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400),
    "max_tokens beyond context": ("/v1/completions", {"prompt": "x", "max_tokens": 10**6}, 400),
    "prompt beyond context": ("/v1/completions", {"prompt": list(range(5, 300))}, 400),
    "max_tokens beyond int32": ("/v1/completions", {"prompt": "x", "max_tokens": 2**40}, 400),
    "token id beyond int32": ("/v1/completions", {"prompt": [1, 2**40]}, 400),
    "top_k beyond int32": ("/v1/completions", {"prompt": "x", "top_k": 2**40}, 400),
    "min_tokens beyond int32": ("/v1/completions", {"prompt": "x", "min_tokens": 2**40}, 400),
    "stop token beyond int32": ("/v1/completions", {"prompt": "x", "stop_token_ids": [2**40]}, 400),
    "seed beyond uint64": ("/v1/completions", {"prompt": "x", "seed": 2**70}, 400),
    "chat max_completion_tokens beyond int32": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2**40}, 400),
    "n zero": ("/v1/completions", {"prompt": "x", "n": 0}, 400),
    "n huge": ("/v1/completions", {"prompt": "x", "n": 10**6}, 400),
    "logprobs too many": ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400),
    "stop wrong type": ("/v1/completions", {"prompt": "x", "stop": 7}, 400),
    "stop token outside vocab": ("/v1/completions", {"prompt": "x", "stop_token_ids": [10**6]}, 400),
    "min_tokens above max_tokens": ("/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, 400),
    "logit_bias above 100": ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101.0}}, 400),
    "logit_bias key not a token id": ("/v1/completions", {"prompt": "x", "logit_bias": {"five": 1.0}}, 400),
    "logit_bias token outside vocab": ("/v1/completions", {"prompt": "x", "logit_bias": {"1000000": 1.0}}, 400),
    "invalid regex": ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a("}}, 400),
    "two structured_outputs": ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a",
                                                                                          "choice": ["b"]}}, 400),
    "empty choice": ("/v1/completions", {"prompt": "x", "structured_outputs": {"choice": []}}, 400),
    "bad grammar": ("/v1/completions", {"prompt": "x", "structured_outputs": {"grammar": "start: (("}}, 400),
    "suffix": ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400),
    "stream_options without stream": ("/v1/completions", {"prompt": "x", "stream_options": {}}, 400),
    "seed not an int": ("/v1/completions", {"prompt": "x", "seed": "abc"}, 400),
    "chat without messages": ("/v1/chat/completions", {"model": MODEL}, 400),
    "chat empty messages": ("/v1/chat/completions", {"messages": []}, 400),
    "chat unknown role": ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    "chat role the template refuses": ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]},
                                       400),
    "chat image part": ("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    "chat top_logprobs without logprobs": ("/v1/chat/completions",
                                           {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
                                           400),
    "chat schema of an unknown type": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}}, 400),
    "chat json_schema without schema": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}, 400),
    "chat unknown response_format": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}}, 400),
    "chat tool_choice required without tools": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400),
    "chat tool_choice names an undeclared tool": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400),
    "chat tool with an invalid schema": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}]}, 400),
    "chat prompt_logprobs while streaming": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1, "stream": True}, 400),
    "chat template kwargs overriding messages": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": []}}, 400),
    "chat unknown model": ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user",
                                                                                    "content": "x"}]}, 404),
    "tokenize both prompt and messages": ("/tokenize", {"prompt": "x", "messages": []}, 400),
    "detokenize id outside vocab": ("/detokenize", {"tokens": [10**6]}, 400),
    "detokenize negative id": ("/detokenize", {"tokens": [-1]}, 400),
}
RAW_BAD_INPUTS = {
    "body not json": ("POST", "/v1/completions", b"{not json", 400),
    "body a json list": ("POST", "/v1/completions", b"[1, 2]", 400),
    "temperature infinite": ("POST", "/v1/completions", b'{"prompt": "x", "temperature": 1e400}', 400),
    "temperature NaN": ("POST", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400),
    "body not utf-8": ("POST", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400),
    "unknown route": ("GET", "/v1/nothing", b"", 404),
    "wrong method": ("GET", "/v1/completions", b"", 405),
    "body too large": ("POST", "/v1/completions", b"{\"prompt\": \"" + b"a" * (MAX_BODY + 10) + b"\"}", 413),
}


def assert_openai_error(response: httpx.Response, status: int) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]


def assert_still_serving(http) -> None:
    assert http.get("/health").status_code == 200
    ok = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "x"


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input(http, case):
    path, body, status = BAD_INPUTS[case]
    assert_openai_error(http.post(path, json=body), status)
    assert_still_serving(http)


@pytest.mark.parametrize("case", sorted(RAW_BAD_INPUTS))
def test_bad_raw_request(http, case):
    method, path, content, status = RAW_BAD_INPUTS[case]
    headers = {"content-type": "application/json"} if content else {}
    assert_openai_error(http.request(method, path, content=content, headers=headers), status)
    assert_still_serving(http)


def test_bad_input_with_the_openai_client_raises_its_error_class(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=10**6)
    assert "maximum context length is 256" in str(info.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="missing", messages=[{"role": "user", "content": "x"}])


def test_chunked_body_over_the_limit_is_413(http):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 1024 + 2):
            yield b"a" * 1024
        yield b'"}'

    response = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in response.request.headers
    assert_openai_error(response, 413)
    assert_still_serving(http)


def test_over_long_prompt_names_the_limits(http):
    response = http.post("/v1/completions", json={"prompt": list(range(5, 300))})
    assert "maximum context length is 256" in response.json()["error"]["message"]
    assert "295" in response.json()["error"]["message"]


# --- apps built for one test -----------------------------------------------------------------------


def test_api_key_is_required_except_for_probes(engine, tokenizer):
    with LiveServer(create_app(engine, tokenizer, MODEL, api_key="sekret")) as live:
        with httpx.Client(base_url=live.url) as http:
            assert_openai_error(http.get("/v1/models"), 401)
            assert_openai_error(http.get("/v1/models", headers={"Authorization": "Bearer nope"}), 401)
            assert http.get("/health").status_code == 200
            assert http.get("/metrics").status_code == 200
        with httpx.Client(base_url=live.url, headers={"Authorization": "bearer sekret"}) as http:
            assert http.get("/v1/models").status_code == 200  # the scheme is case-insensitive
        authed = openai.OpenAI(base_url=live.url + "/v1", api_key="sekret", max_retries=0)
        assert authed.completions.create(model=MODEL, prompt="x", max_tokens=1, temperature=0).choices[0].text == "x"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=live.url + "/v1", api_key="bad", max_retries=0).models.list()


async def test_chat_without_template_is_a_clear_400(engine, plain_tokenizer_dir):
    app = create_app(engine, Tokenizer.from_dir(plain_tokenizer_dir), MODEL)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        response = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert_openai_error(response, 400)
        assert "no chat template" in response.json()["error"]["message"]
        completion = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "temperature": 0})
        assert json.loads(completion.text)["choices"][0]["text"] == "x"


FUZZ_VALUES = [None, True, -1, 0, 1, 3, 2**40, -(2**70), 0.5, -0.5, 1e30, "x", "", [], [1], ["a"], [[1, 2]], [[]],
               {}, {"type": "text"}, {"include_usage": True}]
COMPLETION_FIELDS = ["prompt", "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop",
                     "stop_token_ids", "ignore_eos", "min_tokens", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "logprobs", "echo", "stream", "stream_options", "user", "best_of"]
CHAT_FIELDS = ["messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt", "tools",
               "response_format", "chat_template_kwargs", *COMPLETION_FIELDS[1:]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_random_bodies_never_get_a_500(http, path):
    """120 seeded random mixes of wrong types and extreme values: every answer is a success or
    a 4xx in OpenAI's shape, and the server keeps serving."""
    rng = random.Random(path)
    fields = COMPLETION_FIELDS if path == "/v1/completions" else CHAT_FIELDS
    base = {"prompt": "one two"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    statuses = set()
    for _ in range(120):
        body = dict(base) if rng.random() < 0.7 else {}
        for field in rng.sample(fields, rng.randint(1, 4)):
            body[field] = rng.choice(FUZZ_VALUES)
        response = http.post(path, json=body)
        statuses.add(response.status_code)
        if response.status_code != 200:
            assert_openai_error(response, response.status_code)
            assert 400 <= response.status_code < 500, (body, response.text)
    assert 200 in statuses and 400 in statuses
    assert_still_serving(http)
