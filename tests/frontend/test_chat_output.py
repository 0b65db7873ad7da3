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
        assert [(c.name, json.loads(c.arguments)) for c in out.calls()] == calls


def test_without_parsers_everything_is_content():
    out = run(ChatOutputParser(), ["<think>a</think>", QWEN_CALL])
    assert out.content == "<think>a</think>" + QWEN_CALL and not out.calls()


def test_kimi_ids_and_forced_calls():
    [first, _] = run(ChatOutputParser(tool_format=FORMATS["kimi_k2"]), [KIMI_CALLS]).calls()
    assert first.id == "functions.get_weather:0"
    forced = ChatOutputParser(forced=ToolChoice("required"), id_format=FORMATS["kimi_k2"])
    out = run(forced, ['[{"name": "get_time", "parameters": {"zone": "UTC"}}, ',
                       '{"name": "get_weather", "parameters": {"city": "Rome", "days": 1}}]'])
    assert [(c.id, c.name) for c in out.calls()] == [("functions.get_time:0", "get_time"),
                                                       ("functions.get_weather:1", "get_weather")]
    named = run(ChatOutputParser(forced=ToolChoice("named", "get_time")), ['{"zone": "UTC"}'])
    assert [(c.name, json.loads(c.arguments)) for c in named.calls()] == [("get_time", {"zone": "UTC"})]
    cut = run(ChatOutputParser(forced=ToolChoice("required")), ['[{"name": "get_ti'])
    assert cut.content == '[{"name": "get_ti' and not cut.calls()


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


# --- streamed tool calls: random outputs, random chunkings ---------------------------------------

ALPHABET = 'ab Z09"\\{}[]:,<>/|\n\té漢'


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["str", "int", "float", "bool", "null", "list", "dict"] if depth < 2 else ["str", "int"])
    if kind == "str":
        return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 8)))
    if kind == "int":
        return rng.randint(-50, 5000)
    if kind == "float":
        return rng.choice([0.5, -1.25, 3e-3])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}": random_value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def random_call(rng: random.Random) -> tuple[str, dict]:
    return rng.choice(["get_weather", "f", "search_docs"]), {
        rng.choice(["city", "q", "n", "opts"]) + str(i): random_value(rng) for i in range(rng.randint(0, 3))}


JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null", list: "array",
              dict: "object"}


def declared_types(calls: list[tuple[str, dict]]) -> dict[str, dict[str, str]]:
    """Each call's parameters declared with the JSON type of the value it got."""
    types: dict[str, dict[str, str]] = {}
    for name, arguments in calls:
        for key, value in arguments.items():
            types.setdefault(name, {})[key] = JSON_TYPES[type(value)]
    return types


def written(family: str, calls: list[tuple[str, dict]]) -> str:
    """The calls as the family's model writes them (Qwen3: one block per call; Qwen3.5: XML)."""
    if family == "qwen3_xml":
        return "\n".join("<tool_call>\n<function=" + name + ">\n" + "".join(
            f"<parameter={key}>\n{value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}\n"
            "</parameter>\n" for key, (value) in arguments.items()) + "</function>\n</tool_call>"
            for name, arguments in calls)
    if family == "qwen3":
        return "\n".join('<tool_call>\n' + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
                         + '\n</tool_call>' for name, arguments in calls)
    if family == "kimi_k2":
        return "<|tool_calls_section_begin|>" + "".join(
            f"<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>"
            f"{json.dumps(arguments, ensure_ascii=False)}<|tool_call_end|>"
            for index, (name, arguments) in enumerate(calls)) + "<|tool_calls_section_end|>"
    return "\n\n<｜DSML｜tool_calls>\n" + "".join(
        f'<｜DSML｜invoke name="{name}">\n' + dsml_arguments(arguments) + "\n</｜DSML｜invoke>\n"
        for name, arguments in calls) + "</｜DSML｜tool_calls>"


def check_stream(pieces: list[ParsedDelta]) -> None:
    """Each call opens once, before any of its arguments, with the next index."""
    opened: list[int] = []
    for piece in pieces:
        for delta in piece.tool_calls:
            if delta.opens_call:
                assert delta.index == len(opened) and delta.name
                opened.append(delta.index)
            else:
                assert delta.index in opened and delta.arguments


def parse_pieces(family: str, in_reasoning: bool, pieces: list[str], types=None) -> list[ParsedDelta]:
    parser = ChatOutputParser(reasoning=True, in_reasoning=in_reasoning, tool_format=FORMATS[family.split("_")[0]
                              if family.startswith("qwen3") else family], parameter_types=types)
    return [parser.push(piece) for piece in pieces] + [parser.finish()]


def merged(deltas: list[ParsedDelta]) -> ParsedDelta:
    out = ParsedDelta()
    for delta in deltas:
        out = out.merge(delta)
    return out


STREAMED_FAMILIES = [*FORMATS, "qwen3_xml"]


@pytest.mark.parametrize("family", STREAMED_FAMILIES)
def test_streamed_call_pieces_concatenate_to_the_whole_calls(family):
    """Random outputs (thought, content, parallel calls with awkward argument strings, cut
    anywhere as max_tokens would), each split at random: the pieces, concatenated per call,
    are exactly the calls of the unsplit output, and the text fields agree."""
    rng = random.Random(sum(map(ord, family)))
    for case in range(120):
        calls = [random_call(rng) for _ in range(rng.randint(1, 3))]
        in_reasoning = family == "deepseek_v4"
        thought = "weigh it</think>" if in_reasoning else rng.choice(["", "<think>weigh it</think>"])
        text = thought + rng.choice(["", "Checking. "]) + written(family, calls) + rng.choice(["", "\n"])
        if case % 3 == 0:  # cut short
            text = text[:rng.randint(1, len(text))]
        types = declared_types(calls)
        whole = merged(parse_pieces(family, in_reasoning, [text], types))
        if case % 3:
            assert [(c.name, json.loads(c.arguments)) for c in whole.calls()] == calls
            if family == "kimi_k2":
                assert [c.id for c in whole.calls()] == [f"functions.{n}:{i}" for i, (n, _) in enumerate(calls)]
        for _ in range(4):
            pieces = parse_pieces(family, in_reasoning, split_randomly(text, rng) if len(text) > 1 else [text], types)
            check_stream(pieces)
            streamed = merged(pieces)
            assert (streamed.reasoning, streamed.content) == (whole.reasoning, whole.content)
            assert [(c.name, c.arguments) for c in streamed.calls()] == [(c.name, c.arguments) for c in whole.calls()]


@pytest.mark.parametrize("family", STREAMED_FAMILIES)
def test_calls_open_at_their_name_and_arguments_stream_as_written(family):
    """Fed a character at a time, a call opens before its arguments end, and its arguments
    arrive in many pieces (not whole when the block closes)."""
    calls = [("get_weather", {"city": "Paris", "days": 2}), ("f", {"q": "a long query text"})]
    text = written(family, calls)
    pieces = parse_pieces(family, False, list(text), declared_types(calls))
    check_stream(pieces)
    assert [(c.name, json.loads(c.arguments)) for c in merged(pieces).calls()] == calls
    for index in range(2):
        opened = next(i for i, p in enumerate(pieces) for d in p.tool_calls if d.index == index and d.opens_call)
        with_arguments = [i for i, p in enumerate(pieces) for d in p.tool_calls if d.index == index and d.arguments]
        assert len(with_arguments) >= 10 and opened <= with_arguments[0] < with_arguments[-1]


def test_forced_calls_stream_too():
    """tool_choice required / named: calls open as their names are complete and arguments stream;
    a named call opens with the first character."""
    text = '[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "f", "parameters": {"a": [1, {"b": "}"}]}}]'
    required = ChatOutputParser(forced=ToolChoice("required"))
    deltas = [required.push(char) for char in text] + [required.finish()]
    check_stream(deltas)
    assert [(c.name, json.loads(c.arguments)) for c in merged(deltas).calls()] == [
        ("get_time", {"zone": "UTC"}), ("f", {"a": [1, {"b": "}"}]})]
    assert sum(bool(d.tool_calls) for d in deltas) > 20 and merged(deltas).content == ""
    named = ChatOutputParser(forced=ToolChoice("named", "get_time"))
    first = named.push('{"zo')
    assert [(d.name, d.arguments) for d in first.tool_calls] == [("get_time", '{"zo')]
    rest = merged([named.push('ne": "UTC"}'), named.finish()])
    assert [d.arguments for d in rest.tool_calls] == ['ne": "UTC"}'] and not rest.content


def test_qwen35_xml_values_follow_the_declared_types():
    """Qwen3.5 writes values as text: declared non-strings are converted (when they read as that
    type), strings and undeclared parameters stay text."""
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
            "</parameter>\n<parameter=note>\n3\n</parameter>\n<parameter=when>\nsoon\n</parameter>\n</function>\n"
            "</tool_call>")
    types = {"get_weather": {"city": "string", "days": "integer", "when": "integer"}}
    out = merged(parse_pieces("qwen3_xml", False, list(text), types))
    [call] = out.calls()
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris", "days": 2, "note": "3",
                                                                      "when": "soon"})
    assert out.content == ""
