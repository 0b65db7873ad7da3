"""Structured outputs and a forced tool call on the demo model (SmolLM2-135M-Instruct, a real
tokenizer of 49152 tokens), through the real ``openai`` client; kept to a few short requests."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from conftest import LiveServer

import openinfer
from openinfer.frontend.http import create_app
from openinfer.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    "tags": {"type": "array", "items": {"enum": ["food", "art", "sea"]}, "maxItems": 2},
    "open": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}},
    "required": ["city", "rating", "tags", "open"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "Describe Paris as JSON."}]


@pytest.fixture(scope="module")
def demo_client():
    from openinfer.demo import ensure_demo_model

    try:
        directory = ensure_demo_model(progress=False)
    except Exception as exc:  # the demo package is part of the CI install; say why when it is missing
        pytest.skip(f"demo model unavailable: {exc}")
    engine = openinfer.create_engine(str(directory), device="cpu", max_num_seqs=8)
    try:
        with LiveServer(create_app(engine, Tokenizer.from_dir(directory), "demo")) as live:
            yield openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    finally:
        asyncio.run(engine.close())


def test_sampled_json_schema_outputs_validate_on_the_demo_model(demo_client):
    def run(seed: int):
        return demo_client.chat.completions.create(
            model="demo", messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=64,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}).choices[0]

    with ThreadPoolExecutor(4) as pool:
        for choice in pool.map(run, range(4)):
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_required_tool_choice_on_the_demo_model(demo_client):
    response = demo_client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "What is the weather in Oslo?"}], tools=TOOLS,
        tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=40)
    [call] = response.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome", "Oslo")
