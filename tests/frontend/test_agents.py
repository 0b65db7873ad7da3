"""What agents need, through the real ``openai`` client against the real engine: structured
outputs, tool calling, reasoning split and logit_bias, on tiny random Qwen3 networks behind
Qwen3 / Kimi-K2 / DeepSeek-V4-like tokenizers (see ``agent_checkpoints.py``), and a few requests
on the demo model (SmolLM2)."""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from agent_checkpoints import write_family_model
from conftest import LiveServer
from openai.lib.streaming.chat import ChatCompletionStreamState

import openinfer
from openinfer.frontend.http import create_app
from openinfer.frontend.toolcalls import FORMATS
from openinfer.tokenizer import Tokenizer

FAMILIES = ("qwen3", "kimi_k2", "deepseek_v4")
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                  "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                 "required": ["name", "age"], "additionalProperties": False},
        "role": {"enum": ["admin", "dev", "ops"]}}, "required": ["user", "role"], "additionalProperties": False},
    "arrays": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
        "required": ["tags", "flags"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 3},
                            {"type": "boolean"}, {"type": "null"}]},
        "kind": {"enum": ["a", "b"]}}, "required": ["value", "kind"], "additionalProperties": False},
    "list_of_objects": {"type": "array", "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
        "required": ["id", "ok"], "additionalProperties": False}, "minItems": 1, "maxItems": 2},
}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer",
                                                                                          "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 5}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
TOOL_SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
COMPACT = '"x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}'
ARGS = '%json{"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"], ' \
       '"additionalProperties": false, ' + COMPACT + '}'
# grammars that make a random network write its family's own call format (tool_choice auto parses it)
NATIVE_CALLS = {
    "qwen3": 'start: /[a-z ]{0,6}/ call call?\ncall: "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": " '
             + ARGS + ' "}\\n</tool_call>"',
    "kimi_k2": 'start: <|tool_calls_section_begin|> call call? <|tool_calls_section_end|>\n'
               'call: <|tool_call_begin|> "functions.get_weather:" /[0-9]/ <|tool_call_argument_begin|> '
               + ARGS + ' <|tool_call_end|>',
    "deepseek_v4": 'start: /[a-z ]{0,6}/ "\\n\\n<｜DSML｜tool_calls>\\n" call call? "</｜DSML｜tool_calls>"\n'
                   'call: "<｜DSML｜invoke name=\\"get_weather\\">\\n<｜DSML｜parameter name=\\"city\\" '
                   'string=\\"true\\">" /(Paris|Rome)/ "</｜DSML｜parameter>\\n<｜DSML｜parameter name=\\"days\\" '
                   'string=\\"false\\">" /[1-7]/ "</｜DSML｜parameter>\\n</｜DSML｜invoke>\\n"',
}
# grammars for a thought then an answer; DeepSeek-V4 in thinking mode starts inside the thought
THOUGHTS = {
    "qwen3": 'start: "<think>" /[a-z ]{1,12}/ "</think>\\n\\n" /[a-z ]{1,12}/',
    "kimi_k2": 'start: <think> /[a-z ]{1,12}/ </think> /[a-z ]{1,12}/',
    "deepseek_v4": 'start: /[a-z ]{1,12}/ "</think>" /[a-z ]{1,12}/',
}
THINKING_KWARGS = {"qwen3": None, "kimi_k2": None, "deepseek_v4": {"thinking": True}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


class Served:
    def __init__(self, directory, name: str):
        self.engine = openinfer.create_engine(str(directory), device="cpu", num_kv_blocks=256, max_num_seqs=16)
        self.tokenizer = Tokenizer.from_dir(directory)
        self.live = LiveServer(create_app(self.engine, self.tokenizer, name)).__enter__()
        self.client = openai.OpenAI(base_url=self.live.url + "/v1", api_key="unused", max_retries=0)
        self.name = name

    def close(self) -> None:
        self.live.__exit__(None, None, None)
        asyncio.run(self.engine.close())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    models = {}
    try:
        for family in FAMILIES:
            models[family] = Served(write_family_model(tmp_path_factory.mktemp(family), family), family)
        yield models
    finally:
        for model in models.values():
            model.close()


def chat(model: Served, **body):
    body.setdefault("messages", USER)
    return model.client.chat.completions.create(model=model.name, **body)


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def raw_calls_of(message) -> list[tuple[str, str]]:
    """(name, arguments text): a call cut by max_tokens has arguments that do not parse yet."""
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def stream_chat(model: Served, **body) -> dict:
    """A streamed chat choice reassembled by the ``openai`` package's own stream accumulator
    (``ChatCompletionStreamState``, what ``client.chat.completions.stream`` uses), plus the
    reasoning (not an OpenAI field) concatenated and the number of chunks carrying each call's
    arguments."""
    reasoning, pieces = "", {}
    state = ChatCompletionStreamState()
    body.setdefault("messages", USER)
    for chunk in model.client.chat.completions.create(model=model.name, stream=True, **body):
        state.handle_chunk(chunk)
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            for call in choice.delta.tool_calls or []:
                pieces[call.index] = pieces.get(call.index, 0) + bool(call.function and call.function.arguments)
    [choice] = state.current_completion_snapshot.choices  # (get_final_completion refuses "length")
    finished = choice.finish_reason != "length"
    return {"reasoning": reasoning or None, "content": choice.message.content or None,
            "finish_reason": choice.finish_reason, "calls": calls_of(choice.message) if finished else None,
            "raw_calls": raw_calls_of(choice.message), "ids": [call.id for call in choice.message.tool_calls or []],
            "argument_pieces": [pieces[index] for index in sorted(pieces)]}


# --- structured outputs ----------------------------------------------------------------------


def test_every_sampled_json_schema_response_validates(served):
    """52 seeded requests at temperature 1 over nested objects, enums, arrays and anyOf."""
    model = served["qwen3"]
    jobs = [(name, seed) for seed in range(13) for name in SCHEMAS]

    def run(job):
        name, seed = job
        response = chat(model, temperature=1.0, seed=seed, max_tokens=256, response_format={
            "type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}})
        return name, response.choices[0]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, jobs))
    assert len(results) >= 50
    for name, choice in results:
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


def test_regex_choice_and_json_object_hold(served):
    model = served["qwen3"]
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    regex = model.client.completions.create(model=model.name, prompt="code:", n=8, temperature=1.0, seed=1,
                                            max_tokens=32, extra_body={"structured_outputs": {"regex": pattern}})
    assert all(re.fullmatch(pattern, c.text) for c in regex.choices), [c.text for c in regex.choices]
    choices = ["yes", "no", "maybe later"]
    picked = chat(model, n=8, temperature=1.0, seed=2, max_tokens=16,
                  extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.message.content in choices for c in picked.choices)
    objects = chat(model, n=4, temperature=1.0, seed=3, max_tokens=200,
                   response_format={"type": "json_object"})
    for c in objects.choices:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)


def test_max_tokens_mid_structure_is_length(served):
    response = chat(served["qwen3"], temperature=1.0, seed=0, max_tokens=4, response_format={
        "type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMAS["nested"]}})
    choice = response.choices[0]
    assert choice.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.content)


def test_invalid_schema_is_a_400_naming_the_problem(served):
    with pytest.raises(openai.BadRequestError) as error:
        chat(served["qwen3"], max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                         "properties": {"a": {"type": "wat"}}}}})
    assert "wat" in str(error.value)
    assert chat(served["qwen3"], max_tokens=2).choices[0].message.content is not None  # still serving


# --- logit_bias and prompt logprobs ----------------------------------------------------------


def test_logit_bias_forces_and_forbids_a_token(served):
    model = served["qwen3"]
    forced = model.tokenizer.raw.token_to_id("Paris") or model.tokenizer.encode("Paris")[0]
    response = chat(model, temperature=1.0, seed=5, max_tokens=6, logprobs=True, n=3,
                    logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    for choice in response.choices:
        assert [t.token for t in choice.logprobs.content] == [model.tokenizer.token_text(forced)] * 6
    greedy = chat(model, temperature=0.0, max_tokens=6, logprobs=True, extra_body={"ignore_eos": True})
    first = greedy.choices[0].logprobs.content[0].token
    banned = next(i for i in range(model.tokenizer.vocab_size) if model.tokenizer.token_text(i) == first)
    for temperature in (0.0, 1.0):
        again = chat(model, temperature=temperature, seed=6, max_tokens=12, logprobs=True, n=4,
                     logit_bias={str(banned): -100}, extra_body={"ignore_eos": True})
        for choice in again.choices:
            assert first not in [t.token for t in choice.logprobs.content]


def test_prompt_logprobs_on_chat(served):
    model = served["qwen3"]
    response = chat(model, max_tokens=1, extra_body={"prompt_logprobs": 2})
    table = response.model_extra["prompt_logprobs"]
    prompt_ids = model.tokenizer.encode(model.tokenizer.apply_chat_template(USER), add_special_tokens=False)
    assert len(table) == len(prompt_ids) and table[0] is None
    for token_id, row in zip(prompt_ids[1:], table[1:], strict=True):
        assert str(token_id) in row and row[str(token_id)]["logprob"] <= 0
        assert 2 <= len(row) <= 3


# --- tool calling ----------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_tool_choice_required_always_calls_a_declared_tool(served, family):
    model = served[family]
    response = chat(model, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=8,
                    temperature=1.0, seed=11, max_tokens=200)
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls", choice.message
        [(name, arguments)] = calls_of(choice.message)
        jsonschema.validate(arguments, TOOL_SCHEMAS[name])
    # parallel calls: a random network may keep adding calls until max_tokens (finish_reason
    # "length", no calls); every finished choice holds only valid calls to declared tools
    parallel = chat(model, tools=TOOLS, tool_choice="required", n=4, temperature=1.0, seed=12, max_tokens=300)
    finished = [c for c in parallel.choices if c.finish_reason == "tool_calls"]
    assert finished
    for choice in finished:
        for name, arguments in calls_of(choice.message):
            jsonschema.validate(arguments, TOOL_SCHEMAS[name])


@pytest.mark.parametrize("family", FAMILIES)
def test_named_tool_choice_calls_that_tool(served, family):
    response = chat(served[family], tools=TOOLS, temperature=1.0, seed=4, max_tokens=120, n=2,
                    tool_choice={"type": "function", "function": {"name": "get_time"}})
    for choice in response.choices:
        [(name, arguments)] = calls_of(choice.message)
        assert name == "get_time"
        jsonschema.validate(arguments, TIME)


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_tool_calls_reassemble_to_the_non_streamed_calls(served, family):
    """The family's own call format (forced by a grammar), parsed with tool_choice auto: the
    openai client's accumulation of the stream gives the non-streamed calls, whose arguments
    arrived in pieces as the model wrote them (one token per step)."""
    model = served[family]
    body = {"tools": TOOLS, "temperature": 1.0, "max_tokens": 300,
            "extra_body": {"structured_outputs": {"grammar": NATIVE_CALLS[family]}}}
    pieces = []
    for seed in range(3):
        whole = chat(model, seed=seed, **body).choices[0]
        streamed = stream_chat(model, seed=seed, **body)
        calls = calls_of(whole.message)
        assert calls and all(name == "get_weather" for name, _ in calls), whole.message
        assert streamed["calls"] == calls
        assert streamed["content"] == whole.message.content
        assert whole.finish_reason == streamed["finish_reason"] == "tool_calls"
        assert not any(FORMATS[family].start in (text or "") for text in (whole.message.content,))
        assert len(streamed["argument_pieces"]) == len(calls) and min(streamed["argument_pieces"]) >= 1
        pieces += streamed["argument_pieces"]
        if family == "kimi_k2":  # Kimi's ids are the model's own, the same either way
            assert streamed["ids"] == [call.id for call in whole.message.tool_calls]
    # streamed as written: a request's tokens that reach the frontend between two reads merge into one
    # delta (by design), so on a loaded machine one call's arguments may come whole; over three
    # requests at least one arrives in pieces
    assert max(pieces) >= 2, pieces
    assert chat(model, tools=TOOLS, tool_choice="none", max_tokens=8).choices[0].message.tool_calls is None


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_forced_calls_reassemble_to_the_non_streamed_calls(served, family):
    """tool_choice required (parallel calls) and named, streamed: the same calls as not streamed
    (also when cut by max_tokens: the last call's arguments are then partial, as OpenAI's are)."""
    model = served[family]
    pieces: list[int] = []
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        body = {"tools": TOOLS, "tool_choice": tool_choice, "temperature": 1.0, "max_tokens": 300}
        for seed in range(2):
            whole = chat(model, seed=seed, **body).choices[0]
            streamed = stream_chat(model, seed=seed, **body)
            assert streamed["raw_calls"] == raw_calls_of(whole.message) and whole.message.tool_calls
            assert streamed["finish_reason"] == whole.finish_reason
            if whole.finish_reason == "tool_calls":
                assert min(streamed["argument_pieces"]) >= 1
                pieces += streamed["argument_pieces"]
    # arguments stream as written; tokens that reach the frontend between two reads merge into one delta,
    # so on a loaded machine a short call may come whole (CI saw [17, 10, 1]): over the four requests, pieces
    assert not pieces or max(pieces) >= 2, pieces


@pytest.mark.parametrize("family", FAMILIES)
def test_tool_results_round_trip_through_the_chat_template(served, family):
    """A call the parser read, sent back with its result: the template writes it in the family's
    format, and parsing that prompt gives the same call back."""
    model = served[family]
    response = chat(model, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                    seed=8, max_tokens=200)
    message = response.choices[0].message
    call = message.tool_calls[0]
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    answer = chat(model, messages=history, tools=TOOLS, max_tokens=4)
    assert answer.choices[0].finish_reason in ("stop", "length")
    prompt = model.tokenizer.apply_chat_template(
        [*USER, {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
         {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}], tools=TOOLS)
    fmt = FORMATS[family]
    start = prompt.rindex(fmt.start)
    body = prompt[start + len(fmt.start):prompt.index(fmt.end, start)]
    [parsed] = fmt.parse(body, 0)
    assert (parsed.name, json.loads(parsed.arguments)) == (call.function.name, json.loads(call.function.arguments))
    assert "sunny, 21 C" in prompt


# --- reasoning -------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_reasoning_and_content_split_the_same_streamed_or_not(served, family):
    model = served[family]
    body = {"temperature": 1.0, "max_tokens": 120, "extra_body": {"structured_outputs": {"grammar": THOUGHTS[family]}}}
    if THINKING_KWARGS[family]:
        body["extra_body"]["chat_template_kwargs"] = THINKING_KWARGS[family]
    for seed in range(3):
        whole = chat(model, seed=seed, **body).choices[0]
        reasoning = whole.message.model_extra.get("reasoning_content")
        assert reasoning and whole.message.content, whole.message
        assert "think>" not in reasoning + whole.message.content
        streamed = stream_chat(model, seed=seed, **body)
        assert (streamed["reasoning"], streamed["content"]) == (reasoning, whole.message.content)


def test_enable_thinking_false_gives_content_only(served):
    model = served["qwen3"]
    body = {"max_tokens": 16, "extra_body": {"chat_template_kwargs": {"enable_thinking": False},
                                             "structured_outputs": {"regex": "[a-z]{2,8}"}}}
    message = chat(model, **body).choices[0].message
    assert message.content and not message.model_extra.get("reasoning_content")


def test_thought_cut_by_max_tokens_is_reasoning_only(served):
    model = served["deepseek_v4"]
    body = {"max_tokens": 3, "extra_body": {"chat_template_kwargs": {"thinking": True},
                                            "structured_outputs": {"regex": "[a-z]{8,12}</think>ok"}}}
    choice = chat(model, **body).choices[0]
    assert choice.finish_reason == "length" and choice.message.model_extra["reasoning_content"]
    assert not choice.message.content


def test_value_constraints_follow_the_thought_when_the_prompt_opens_one(served):
    """DeepSeek-V4 in thinking mode: the prompt ends inside <think>, so the thought runs free and the
    JSON value (or the forced call) comes after </think> (a bias on </think> keeps the random
    network's thoughts short)."""
    model = served["deepseek_v4"]
    think_end = model.tokenizer.raw.token_to_id("</think>")
    common = {"temperature": 1.0, "max_tokens": 200, "logit_bias": {str(think_end): 6},
              "extra_body": {"chat_template_kwargs": {"thinking": True}}}
    thoughts = 0
    for seed in range(3):
        body = {**common, "seed": seed, "response_format": {
            "type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMAS["any_of"]}}}
        whole = chat(model, **body).choices[0]
        assert whole.finish_reason == "stop", whole.message
        jsonschema.validate(json.loads(whole.message.content), SCHEMAS["any_of"])
        reasoning = whole.message.model_extra.get("reasoning_content")
        thoughts += bool(reasoning)
        streamed = stream_chat(model, **body)
        assert (streamed["reasoning"], streamed["content"]) == (reasoning, whole.message.content)
        forced = chat(model, **common, seed=seed, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        [(name, arguments)] = calls_of(forced.choices[0].message)
        jsonschema.validate(arguments, TOOL_SCHEMAS[name])
    assert thoughts  # at least one sampled thought was split off
