"""Issue 11's hardening of the HTTP server, each check against the fake engine on loopback:
logprob bytes, bad text (lone surrogates), template-argument collisions, connection handling
after errors, a responsive /health under a huge body, disconnects of non-streamed requests,
refused fields and ranges, the models listing, metrics of aborts and the queue-wait timeout."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import LiveServer
from fakes import FakeEngine
from tiny_checkpoints import byte_token_ids

from openinfer.frontend.http import create_app
from openinfer.tokenizer import Tokenizer

MODEL = "tiny-fake"


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_dir)


@pytest.fixture(scope="module")
def engine(tokenizer, tokenizer_dir) -> FakeEngine:
    return FakeEngine(tokenizer.vocab_size, tokenizer.eos_token_ids, max_model_len=256,
                      tokenizer_path=str(tokenizer_dir), sample_low=3)


@pytest.fixture(scope="module")
def server(engine, tokenizer):
    with LiveServer(create_app(engine, tokenizer, MODEL)) as live:
        yield live


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as session:
        yield session


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


# --- 2. logprob bytes ----------------------------------------------------------------------------


def test_emoji_reply_logprob_bytes_join_to_its_utf8(client, tokenizer):
    reply = "<|im_start|>user\n🙂"
    num_ids = len(tokenizer.encode(reply, add_special_tokens=False))
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "🙂"}], temperature=0, max_tokens=num_ids,
        logprobs=True, top_logprobs=2, extra_body={"skip_special_tokens": False})
    choice = response.choices[0]
    assert choice.message.content == reply
    entries = choice.logprobs.content
    assert b"".join(bytes(e.bytes) for e in entries) == reply.encode("utf-8")
    assert all(bytes(top.bytes).decode("utf-8", "backslashreplace") == top.token
               for e in entries for top in e.top_logprobs)
    assert "ðŁ" not in "".join(e.token for e in entries)  # no byte-alphabet characters leak


def test_split_character_logprob_bytes_and_text_offsets(client, tokenizer):
    text = "a🙂b"
    ids = byte_token_ids(tokenizer, text)  # the emoji's 4 bytes as 4 tokens
    response = client.completions.create(model=MODEL, prompt=ids, max_tokens=len(ids), temperature=0,
                                         logprobs=1)
    choice = response.choices[0]
    assert choice.text == text
    logprobs = choice.logprobs
    assert logprobs.tokens[0] == "a" and logprobs.tokens[-1] == "b"
    assert logprobs.tokens[1] == "\\xf0"  # a partial character shows its byte, escaped
    # offsets are in characters of the text: the emoji counts once
    assert logprobs.text_offset == [0, 1, 1, 1, 1, 2]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                          temperature=0, max_tokens=1, logprobs=True)
    assert chat.choices[0].logprobs.content[0].bytes == list(tokenizer.token_bytes(
        tokenizer.encode("<|im_start|>", add_special_tokens=False)[0]))
