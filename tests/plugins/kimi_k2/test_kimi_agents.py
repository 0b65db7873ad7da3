"""Structured outputs and a forced tool call on a tiny ``kimi_k2`` checkpoint with a tiktoken
vocabulary (the grammar engine reads ``tiktoken.model``), through the real ``openai`` client."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

import openinfer
from openinfer.frontend.http import create_app
from openinfer.tokenizer import Tokenizer
from tests.helpers.tiny_deepseek_v3 import write_tiny_deepseek_v3
from tests.helpers.tiny_kimi_tokenizer import write_kimi_tokenizer
from tests.plugins.kimi_k2.test_chat_serving import LiveServer

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["Paris", "Lyon"]}, "sure": {"type": "boolean"}},
          "required": ["answer", "sure"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kimi-agents") / "tiny-kimi-k2"
    specials = write_kimi_tokenizer(directory)
    write_tiny_deepseek_v3(directory, seed=7, vocab_size=specials["vocab_size"], bos_token_id=specials["[BOS]"],
                           eos_token_id=specials["[EOS]"])
    config = json.loads((directory / "config.json").read_text())
    config.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"])
    (directory / "config.json").write_text(json.dumps(config))
    engine = openinfer.create_engine(str(directory), device="cpu", num_kv_blocks=64)
    try:
        with LiveServer(create_app(engine, Tokenizer.from_dir(directory), "kimi")) as live:
            yield openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    finally:
        asyncio.run(engine.close())


def test_json_schema_and_required_tool_call_on_kimi(client):
    response = client.chat.completions.create(
        model="kimi", messages=MESSAGES, temperature=1.0, seed=3, n=2, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    called = client.chat.completions.create(model="kimi", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, temperature=0, max_tokens=120)
    assert called.choices[0].finish_reason == "tool_calls", called.choices[0]
    [call] = called.choices[0].message.tool_calls
    assert call.id == "functions.get_weather:0" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
