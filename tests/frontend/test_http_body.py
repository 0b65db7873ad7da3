"""Request bodies decoded by msgspec with ``json.loads`` as the fallback: every body decodes to
what ``json.loads`` gives, or fails as ``json.loads`` fails, and the server answers as before."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import LiveServer

from openinfer.frontend.http import create_app
from openinfer.frontend.http.body import decode_json

MODEL = "tiny-fake"

BODIES = [
    b'{"prompt": [1, 2, 3], "max_tokens": 4}',
    b'{"a": 1, "a": 2}',  # duplicate keys: the last wins
    b'{"a": 123456789012345678901234567890, "b": -9223372036854775809}',  # beyond 64 bits
    b'{"a": -0.0, "b": 1.5e-400, "c": 1E5, "d": "\\u0000\\ud83d\\ude00\x7f"}',
    b'{"a": "\\ud800"}',  # a lone surrogate escape: msgspec refuses it, json.loads decodes it
    b'{"a": NaN, "b": Infinity, "c": 1e400}',
    b'\xef\xbb\xbf{"a": 1}',  # a UTF-8 byte order mark
    '{"a": "x"}'.encode("utf-16"),
    b'{"a": "\xff"}',  # not UTF-8
    b'{"a": "x\ny"}',  # a raw control character in a string
    b'{"a": 1} x',
    b'{"a": 01}',
    b'{"a": .5}',
    b'{"a": ',
    b'',
    b'[' * 100_000 + b']' * 100_000,  # too deep for either decoder
]


def outcome(decode, body: bytes):
    try:
        return "ok", decode(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return "error", type(exc)


@pytest.mark.parametrize("body", BODIES)
def test_decode_json_gives_what_json_loads_gives(body):
    expected, got = outcome(json.loads, body), outcome(decode_json, body)
    assert got[0] == expected[0] and repr(got[1]) == repr(expected[1])  # repr: NaN != NaN


@pytest.fixture(scope="module")
def http(engine, tokenizer):
    with LiveServer(create_app(engine, tokenizer, MODEL)) as live, \
            httpx.Client(base_url=live.url, timeout=30) as session:
        yield session


def post(http, content: bytes) -> httpx.Response:
    return http.post("/v1/completions", content=content, headers={"content-type": "application/json"})


def test_body_msgspec_refuses_but_json_loads_reads_is_served(http):
    response = post(http, b'\xef\xbb\xbf' + json.dumps({"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2,
                                                         "temperature": 0}).encode())
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == 3


@pytest.mark.parametrize("content", [b'{"prompt": [1, 2', b'{"prompt": "a"} x', b'{"prompt": "\xff"}'])
def test_malformed_bodies_are_400_in_openai_shape(http, content):
    response = post(http, content)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_token_id_prompt_with_echo_returns_its_text(http, tokenizer):
    ids = tokenizer.encode("one two three")
    response = post(http, json.dumps({"model": MODEL, "prompt": ids, "max_tokens": 1, "echo": True,
                                      "temperature": 0}).encode())
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"].startswith(tokenizer.decode(ids))
