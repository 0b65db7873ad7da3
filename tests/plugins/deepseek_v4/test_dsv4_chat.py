"""The DeepSeek-V4 chat encoding: the encoder itself, its discovery through the plugin hook by the
tokenizer (the checkpoint has no Jinja template), and a chat request over HTTP."""

import json
import shutil

import pytest
from openinfer_deepseek_v4.chat import DeepseekV4ChatEncoder

from openinfer import InvalidRequestError
from openinfer.tokenizer import Tokenizer
from tests.plugins.deepseek_v4.dsv4_helpers import write_tokenizer

B, E, U, A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
    {"role": "user", "content": "2+2?"},
]


def test_chat_mode():
    text = DeepseekV4ChatEncoder().encode(CONVERSATION)
    assert text == f"{B}Be brief.{U}Hi{A}</think>Hello!{E}{U}2+2?{A}</think>"


def test_thinking_mode_opens_a_thought_and_drops_old_reasoning():
    encoder = DeepseekV4ChatEncoder()
    text = encoder.encode(CONVERSATION, thinking=True)
    assert text == f"{B}Be brief.{U}Hi{A}</think>Hello!{E}{U}2+2?{A}<think>"
    assert encoder.encode(CONVERSATION, thinking_mode="thinking") == text
    kept = encoder.encode(CONVERSATION, thinking=True, drop_thinking=False)
    assert kept == f"{B}Be brief.{U}Hi{A}<think>greet back</think>Hello!{E}{U}2+2?{A}<think>"
    prefilled = encoder.encode([*CONVERSATION, {"role": "assistant", "content": "4", "reasoning_content": "sum"}],
                               add_generation_prompt=False, thinking=True)
    assert prefilled.endswith(f"{U}2+2?{A}<think>sum</think>4{E}")


def test_tool_calls_and_results():
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    text = DeepseekV4ChatEncoder().encode(messages, tools=tools)
    dsml = "｜DSML｜"
    call = (f'\n\n<{dsml}tool_calls>\n<{dsml}invoke name="weather">\n'
            f'<{dsml}parameter name="city" string="true">Paris</{dsml}parameter>\n'
            f'<{dsml}parameter name="days" string="false">2</{dsml}parameter>\n</{dsml}invoke>\n</{dsml}tool_calls>')
    assert text.startswith(B + "## Tools") and '"name": "weather"' in text
    assert text.endswith(f"{U}Weather?{A}</think>{call}{E}{U}<tool_result>sunny</tool_result>{A}</think>")


@pytest.mark.parametrize("messages, field", [
    ([{"role": "user", "content": f"sneaky {E}"}], "reserved"),
    ([{"role": "robot", "content": "x"}], "role"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "[1"}}]}],
     "arguments"),
])
def test_bad_messages_are_invalid_requests(messages, field):
    with pytest.raises(InvalidRequestError, match=field):
        DeepseekV4ChatEncoder().encode(messages)


@pytest.fixture(scope="module")
def chat_model_dir(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv4-chat")
    for file in tiny[0].iterdir():
        shutil.copy(file, path / file.name)
    return write_tokenizer(path)


def test_tokenizer_finds_the_plugin_encoder(chat_model_dir):
    tokenizer = Tokenizer.from_dir(chat_model_dir)
    assert tokenizer.chat_template is None and isinstance(tokenizer.chat_encoder, DeepseekV4ChatEncoder)
    text = tokenizer.apply_chat_template(CONVERSATION[1:2], thinking=True)
    assert text == f"{B}{U}Hi{A}<think>"
    assert tokenizer.encode(text, add_special_tokens=False) == [0, 2] + tokenizer.encode("Hi", False) + [3, 4]


def test_chat_completion_over_http(chat_model_dir):
    from fastapi.testclient import TestClient

    from openinfer import create_engine
    from openinfer.frontend.http import create_app

    engine = create_engine(chat_model_dir, device="cpu")
    tokenizer = Tokenizer.from_dir(chat_model_dir)
    try:
        with TestClient(create_app(engine, tokenizer, "dsv4-tiny")) as client:
            body = {"model": "dsv4-tiny", "messages": CONVERSATION, "max_tokens": 5, "temperature": 0,
                    "chat_template_kwargs": {"thinking": True}}
            reply = client.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            expected_prompt = tokenizer.encode(DeepseekV4ChatEncoder().encode(CONVERSATION, thinking=True), False)
            assert reply.json()["usage"]["prompt_tokens"] == len(expected_prompt)
            assert reply.json()["usage"]["completion_tokens"] == 5
            bad = client.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": E}]})
            assert bad.status_code == 400 and "reserved" in bad.json()["error"]["message"]
    finally:
        engine.close_sync()
