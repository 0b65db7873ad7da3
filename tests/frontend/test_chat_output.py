"""The chat output parser (reasoning / content / tool calls) and the tool-call formats, on text."""

from __future__ import annotations

import json
import random

import pytest

from openinfer.errors import InvalidRequestError
from openinfer.frontend.chat_output import ChatOutputParser, ParsedDelta
from openinfer.frontend.toolcalls import FORMATS, ToolChoice, forced_call_constraint, resolve_tool_choice
from openinfer.frontend.toolcalls.formats import dsml_arguments

QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
KIMI_CALLS = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
              '{"city": "Paris", "days": 2}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
              '<|tool_call_argument_begin|>{"zone": "CET"}<|tool_call_end|><|tool_calls_section_end|>')
DSML_CALL = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
             + dsml_arguments({"city": "Paris", "days": 2}) + '\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
CASES = [  # (format, starts in reasoning, text, expected reasoning, content, calls)
    ("qwen3", False, "<think>\nhmm</think>\n\nIt is sunny.", "\nhmm", "\n\nIt is sunny.", []),
    ("qwen3", False, "Let me check.\n" + QWEN_CALL + "\n" + QWEN_CALL, "", "Let me check.\n",
     [("get_weather", {"city": "Paris", "days": 2})] * 2),
    ("qwen3", False, "<think>plan</think>" + QWEN_CALL, "plan", "", [("get_weather", {"city": "Paris", "days": 2})]),
    ("qwen3", False, "a < b and <tool_cal", "", "a < b and <tool_cal", []),  # a marker prefix at the end is text
    ("qwen3", False, "x <tool_call>\nnot json\n</tool_call> y", "", "x <tool_call>\nnot json\n</tool_call>y", []),
    ("qwen3", False, "cut <tool_call>\n{\"name\": ", "", "cut <tool_call>\n{\"name\": ", []),
    ("kimi_k2", False, "<think>ok</think>" + KIMI_CALLS, "ok", "",
     [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "CET"})]),
    ("deepseek_v4", True, "thinking...</think>Checking." + DSML_CALL, "thinking...", "Checking.\n\n",
     [("get_weather", {"city": "Paris", "days": 2})]),
    ("deepseek_v4", True, "cut off mid-thought", "cut off mid-thought", "", []),
]


def run(parser: ChatOutputParser, pieces: list[str]) -> ParsedDelta:
    out = ParsedDelta()
    for piece in pieces:
        out = out.merge(parser.push(piece))
    return out.merge(parser.finish())


def split_randomly(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize(("family", "in_reasoning", "text", "reasoning", "content", "calls"), CASES)
def test_any_split_of_the_text_parses_the_same(family, in_reasoning, text, reasoning, content, calls):
    rng = random.Random(0)
    for attempt in range(30):
        pieces = [text] if attempt == 0 else split_randomly(text, rng)
        parser = ChatOutputParser(reasoning=True, in_reasoning=in_reasoning, tool_format=FORMATS[family])
        out = run(parser, pieces)
        assert (out.reasoning, out.content) == (reasoning, content), pieces
        assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == calls


def test_without_parsers_everything_is_content():
    out = run(ChatOutputParser(), ["<think>a</think>", QWEN_CALL])
    assert out.content == "<think>a</think>" + QWEN_CALL and not out.tool_calls


def test_kimi_ids_and_forced_calls():
    [first, _] = run(ChatOutputParser(tool_format=FORMATS["kimi_k2"]), [KIMI_CALLS]).tool_calls
    assert first.id == "functions.get_weather:0"
    forced = ChatOutputParser(forced=ToolChoice("required"), id_format=FORMATS["kimi_k2"])
    out = run(forced, ['[{"name": "get_time", "parameters": {"zone": "UTC"}}, ',
                       '{"name": "get_weather", "parameters": {"city": "Rome", "days": 1}}]'])
    assert [(c.id, c.name) for c in out.tool_calls] == [("functions.get_time:0", "get_time"),
                                                       ("functions.get_weather:1", "get_weather")]
    named = run(ChatOutputParser(forced=ToolChoice("named", "get_time")), ['{"zone": "UTC"}'])
    assert [(c.name, json.loads(c.arguments)) for c in named.tool_calls] == [("get_time", {"zone": "UTC"})]
    cut = run(ChatOutputParser(forced=ToolChoice("required")), ['[{"name": "get_ti'])
    assert cut.content == '[{"name": "get_ti' and not cut.tool_calls


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "g"}}]


def test_tool_choice_resolution_and_forced_schemas():
    assert resolve_tool_choice(None, None).mode == "none"
    assert resolve_tool_choice(TOOLS, None).mode == "auto"
    assert resolve_tool_choice(TOOLS, {"type": "function", "function": {"name": "g"}}) == ToolChoice("named", "g")
    required = json.loads(forced_call_constraint(TOOLS, ToolChoice("required"), False).json_schema)
    assert required["maxItems"] == 1 and [i["properties"]["name"]["enum"] for i in required["items"]["anyOf"]] == [
        ["f"], ["g"]]
    assert "maxItems" not in json.loads(forced_call_constraint(TOOLS, ToolChoice("required"), True).json_schema)
    assert json.loads(forced_call_constraint(TOOLS, ToolChoice("named", "g")).json_schema) == {"type": "object"}
    assert forced_call_constraint(TOOLS, ToolChoice("auto")) is None


@pytest.mark.parametrize(("tools", "choice", "named"), [
    (None, "required", "needs tools"),
    (TOOLS, "sometimes", "tool_choice must be"),
    (TOOLS, {"type": "function", "function": {"name": "h"}}, "not among"),
    (TOOLS, {"type": "function"}, "named tool_choice"),
    ([{"type": "function", "function": {"name": "f"}}] * 2, "auto", "declared twice"),
    ([{"type": "retrieval"}], "auto", "tools[0]"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}], "auto", "wat"),
])
def test_bad_tools_and_choices_are_refused(tools, choice, named):
    with pytest.raises(InvalidRequestError) as error:
        resolve_tool_choice(tools, choice)
    assert named in str(error.value)
