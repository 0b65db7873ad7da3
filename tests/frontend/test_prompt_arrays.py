"""A /v1/completions prompt of token ids travels as one int32 array from the HTTP body to the
engine: parsed from the body's JSON text (``token_id_array``), beside the request through the
engine-core protocol (its ``prompt_token_ids`` empty) and admitted as it is. Every id reaches the
engine unchanged, whatever the engine; whatever is not a flat list of token ids decodes and is
refused exactly as before."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import numpy as np
import pytest
from conftest import LiveServer
from tiny_checkpoints import write_tiny_qwen3, write_tokenizer

import openinfer
from openinfer.engine_core.protocol import PROMPT_DTYPE, prompt_from_buffer
from openinfer.errors import InvalidRequestError
from openinfer.frontend.http import create_app
from openinfer.frontend.http.body import decode_json, decode_json_token_ids
from openinfer.frontend.http.schemas import INT32_LIMIT, TokenIdArray, token_id_array
from openinfer.runtime.validation import validate_request
from openinfer.v1 import engine_pb2 as pb

MODEL = "tiny-fake"

NOT_TOKEN_IDS = [b"[]", b"[ ]", b"[1, true]", b"[1, 1.0]", b"[1, -1]", b"[-0]", b"[1, 2147483648]",
                 b"[1, 99999999999999999999999]", b"[[1]]", b'"12"', b"[1, null]", b"[1e3]", b'[1, "2"]',
                 b"12", b"{}", b"[1, {}]"]


def json_text(ids: list[int], rng: np.random.Generator) -> bytes:
    """``ids`` as a JSON array with random JSON whitespace around every element."""
    spaces = [" ", "\n", "\t", "\r", "", ""]
    pad = [spaces[i] for i in rng.integers(0, len(spaces), size=2 * len(ids) + 2)]
    inner = ",".join(f"{pad[2 * i]}{v}{pad[2 * i + 1]}" for i, v in enumerate(ids))
    return f"{pad[-2]}[{inner}]{pad[-1]}".encode()


@pytest.mark.parametrize("seed", range(6))
def test_token_id_array_parses_every_valid_id_list(seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, [10, 1000, INT32_LIMIT][seed % 3], size=int(rng.integers(1, 3000))).tolist()
    ids[0] = [0, INT32_LIMIT - 1, 7][seed % 3]  # the range's ends
    parsed = token_id_array(json_text(ids, rng))
    assert parsed is not None and parsed.dtype == np.int32 and not parsed.flags.writeable
    assert parsed.tolist() == ids


@pytest.mark.parametrize("raw", NOT_TOKEN_IDS)
def test_token_id_array_leaves_everything_else_to_pydantic(raw):
    assert token_id_array(raw) is None


@pytest.mark.parametrize("raw", NOT_TOKEN_IDS + [b"[1, 2, 3]", b"[1,\n2]"])
def test_completion_bodies_decode_as_json_loads_does_but_for_the_id_array(raw):
    body = b'{"model": "m", "prompt": ' + raw + b', "max_tokens": 3, "x": {"y": [1.5, null]}}'
    decoded, expected = decode_json_token_ids(body), json.loads(body)
    if isinstance(decoded["prompt"], TokenIdArray):
        assert decoded["prompt"].ids.tolist() == expected.pop("prompt") and decoded.pop("prompt")
    assert decoded == expected


@pytest.mark.parametrize("body", [b'{"prompt": [1, 2], "a": NaN}', b'{"prompt": [1, 2], "a": "\\ud800"}', b"[1, 2]",
                                  b'{"prompt": [1, 2]} x', b'{"a": 01}'])
def test_bodies_msgspec_refuses_go_to_decode_json(body):
    """(NaN, lone surrogate escapes, malformed JSON): decoded or refused as ``decode_json`` does."""
    try:
        expected = repr(decode_json(body))
    except ValueError as exc:
        expected = type(exc)
    try:
        got = repr(decode_json_token_ids(body))
    except ValueError as exc:
        got = type(exc)
    assert got == expected


class ArrayEngine:
    """Wraps a FakeEngine as an engine that takes the prompt beside the request, recording both."""

    def __init__(self, engine):
        self.engine = engine
        self.received: list[tuple[pb.GenerateRequest, np.ndarray]] = []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def generate_prompt_array(self, request: pb.GenerateRequest, prompt_ids: np.ndarray
                                    ) -> AsyncIterator[pb.TokenEvent]:
        self.received.append((pb.GenerateRequest.FromString(request.SerializeToString()), prompt_ids))
        whole = pb.GenerateRequest.FromString(request.SerializeToString())
        whole.prompt_token_ids.extend(prompt_ids.tolist())
        async for event in self.engine.generate(whole):
            yield event


def completion(http: httpx.Client, body: bytes) -> httpx.Response:
    return http.post("/v1/completions", content=body, headers={"content-type": "application/json"})


def test_the_prompt_reaches_any_engine_unchanged(engine, tokenizer):
    """A plain EngineHandle gets the ids in prompt_token_ids; an array-taking one beside an
    otherwise equal request; the text is the same either way."""
    rng = np.random.default_rng(3)
    ids = rng.integers(3, 300, size=200).tolist()
    body = b'{"prompt": ' + json_text(ids, rng) + b', "max_tokens": 5, "temperature": 0}'
    texts = []
    array_engine = ArrayEngine(engine)
    for handle in (engine, array_engine):
        with LiveServer(create_app(handle, tokenizer, MODEL)) as live, \
                httpx.Client(base_url=live.url, timeout=30) as http:
            response = completion(http, body)
            assert response.status_code == 200, response.text
            texts.append(response.json()["choices"][0]["text"])
            assert response.json()["usage"]["prompt_tokens"] == len(ids)
    assert texts[0] == texts[1]
    assert list(engine.submitted[-2].prompt_token_ids) == ids
    request, prompt = array_engine.received[-1]
    assert len(request.prompt_token_ids) == 0 and prompt.dtype == np.int32 and prompt.tolist() == ids


def test_bad_id_prompts_are_refused_as_before(engine, tokenizer):
    with LiveServer(create_app(ArrayEngine(engine), tokenizer, MODEL)) as live, \
            httpx.Client(base_url=live.url, timeout=30) as http:
        for raw in (b"[1, -1]", b"[1, 1.5]", b"[]", b"[1, 2147483648]"):
            response = completion(http, b'{"prompt": ' + raw + b', "max_tokens": 2}')
            assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", raw
        vocab = engine.info().vocab_size
        response = completion(http, b'{"prompt": [1, %d], "max_tokens": 2}' % vocab)
        assert response.status_code == 400 and "outside the vocabulary" in response.json()["error"]["message"]


def test_the_engine_checks_a_prompt_given_beside_the_request():
    request = pb.GenerateRequest(request_id="r")
    validate_request(request, 100, 64, np.array([1, 2, 3], np.int32))
    for prompt, message in ((np.array([], np.int32), "empty"), (np.array([1, 100], np.int32), "vocabulary"),
                            (np.array([1, -5], np.int32), "vocabulary"), (np.arange(64, dtype=np.int32), "context")):
        with pytest.raises(InvalidRequestError, match=message):
            validate_request(request, 100, 64, prompt)
    with pytest.raises(InvalidRequestError, match="once"):
        validate_request(pb.GenerateRequest(request_id="r", prompt_token_ids=[1]), 100, 64, np.array([1], np.int32))


def test_the_protocol_prompt_buffer_is_read_in_place_or_refused():
    ids = np.array([5, 0, INT32_LIMIT - 1], np.int32)
    assert prompt_from_buffer(ids.astype(PROMPT_DTYPE).tobytes()).tolist() == ids.tolist()
    for bad in (b"\x01\x02\x03", "text", 12):
        with pytest.raises(InvalidRequestError, match="int32"):
            prompt_from_buffer(bad)


def test_the_in_process_engine_admits_an_array_as_the_request_it_replaces(tmp_path):
    """Greedy tokens of a prompt given beside the request equal those of the same ids inside it."""
    directory = tmp_path / "model"
    directory.mkdir()
    write_tokenizer(directory)
    write_tiny_qwen3(directory)
    engine = openinfer.create_engine(str(directory), device="cpu", num_kv_blocks=64)
    prompt = np.random.default_rng(0).integers(3, 300, size=40).astype(np.int32)

    def request(rid: str, inside: bool) -> pb.GenerateRequest:
        return pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt.tolist() if inside else [],
                                  sampling=pb.SamplingParams(temperature=0.0),
                                  stop=pb.StopConditions(max_tokens=6, ignore_eos=True))

    async def tokens(events: AsyncIterator[pb.TokenEvent]) -> list[int]:
        return [t for e in [e async for e in events] if e.WhichOneof("event") == "tokens" for t in e.tokens.ids]

    async def both() -> tuple[list[int], list[int]]:
        return (await tokens(engine.generate(request("inside", True))),
                await tokens(engine.generate_prompt_array(request("beside", False), prompt)))

    try:
        inside, beside = asyncio.run(both())
    finally:
        engine.close_sync()
    assert len(inside) == 6 and inside == beside


def test_echo_reads_the_array_prompt_as_ids(engine, tokenizer):
    """Echo (text and logprob tables) reads the prompt ids one by one: the same reply whether the
    engine takes the array or the request's ids."""
    ids = np.random.default_rng(5).integers(3, 300, size=50).tolist()
    body = json.dumps({"prompt": ids, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1}).encode()
    replies = []
    for handle in (engine, ArrayEngine(engine)):
        with LiveServer(create_app(handle, tokenizer, MODEL)) as live, \
                httpx.Client(base_url=live.url, timeout=30) as http:
            response = completion(http, body)
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            replies.append((choice["text"], choice["logprobs"]["tokens"]))
    assert replies[0] == replies[1] and replies[0][0].startswith(tokenizer.decode(ids))
