"""Incremental readers of tool-call blocks: fed a block's text as it is generated, they open each
call as soon as its name is complete and pass its arguments on as the model writes them.

Invariant (what makes streamed and non-streamed responses agree): a reader's output depends only
on the text fed so far, never on how it was cut into pieces, and what it emitted for a prefix
is a prefix of what it emits for any longer text. Pieces that may still change meaning (a
partial end marker, trailing whitespace that a value drops) are held back until they cannot.

Readers never see their block's end marker: the chat output parser finds it, feeds the text
before it and calls :meth:`BlockReader.end`.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from openinfer.frontend.reasoning import held_back
from openinfer.frontend.toolcalls.calls import ToolCall, ToolCallDelta, new_call_id

CallId = Callable[[str, int], str]  # (function name, call index) → call id


class BlockReader(ABC):
    """One block (or a forced call's output). Call indices start at ``first_index``."""

    def __init__(self, first_index: int, call_id: CallId | None = None):
        self.first_index = first_index
        self._num_calls = 0
        self._call_id = call_id or (lambda name, index: new_call_id())

    @property
    def num_calls(self) -> int:
        """Calls opened so far."""
        return self._num_calls

    def _open(self, name: str, call_id: str | None = None) -> ToolCallDelta:
        index = self.first_index + self._num_calls
        self._num_calls += 1
        return ToolCallDelta(index, call_id if call_id is not None else self._call_id(name, index), name)

    def _arguments(self, text: str) -> list[ToolCallDelta]:
        return [ToolCallDelta(self.first_index + self.num_calls - 1, arguments=text)] if text else []

    @abstractmethod
    def feed(self, text: str) -> list[ToolCallDelta]:
        """More of the block's text; the pieces it completes."""

    def end(self) -> list[ToolCallDelta] | None:
        """The block is closed: its last pieces, or None when it held no call (it is then content)."""
        return [] if self.num_calls else None


class JsonObjectEnd:
    """Where a JSON object or array that starts the scanned text ends, across pieces."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def scan(self, text: str) -> int | None:
        """The length of ``text`` up to and including the value's closing bracket, or None when
        the value goes on past it."""
        for position, char in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return position + 1
        return None


class UntilMarker:
    """Text up to an end marker; holds back what may be the marker's beginning. ``strip``:
    "space" drops the whitespace around the text, "newline" one newline at each end (Qwen3.5's
    parameter values sit on their own lines), "" keeps everything; what may be trailing is held
    back until it is not."""

    def __init__(self, marker: str, strip: str = ""):
        self.marker = marker
        self.strip = strip
        self.started = not strip
        self.held = ""

    def _trailing(self, body: str) -> str:
        if self.strip == "space":
            return body.rstrip()
        if self.strip == "newline" and body.endswith("\n"):
            return body[:-1]
        return body

    def feed(self, text: str) -> tuple[str, str | None]:
        """(text to pass on, the text after the marker — None while the marker has not come)."""
        text = self.held + text
        self.held = ""
        if not self.started:
            if self.strip == "space":
                text = text.lstrip()
            if not text:
                return "", None
            if self.strip == "newline" and text.startswith("\n"):
                text = text[1:]
            self.started = True
        at = text.find(self.marker)
        if at >= 0:
            return self._trailing(text[:at]), text[at + len(self.marker):]
        keep = held_back(text, self.marker)
        passed = self._trailing(text[:len(text) - keep])
        self.held = text[len(passed):]
        return passed, None


_JSON_CALL = re.compile(r'\{\s*"name"\s*:\s*(?P<name>"(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')


class JsonCallsReader(BlockReader):
    """Calls written as ``{"name": "f", "arguments": {...}}`` (``"parameters"`` also read), one
    after the other with anything between them (Qwen3's block body; the JSON array that a
    forced ``tool_choice: required`` generates). The arguments are the object's text as written.

    ``whole``: a parser of the complete block, for calls the header pattern does not open (keys
    in another order); they are emitted whole when the block ends."""

    def __init__(self, first_index: int, call_id: CallId | None = None,
                 whole: Callable[[str], list[ToolCall] | None] | None = None):
        super().__init__(first_index, call_id)
        self._whole = whole
        self._seen = ""  # the block so far, for ``whole``
        self._pending = ""  # text not yet placed, while looking for a call
        self._arguments_end: JsonObjectEnd | None = None

    def feed(self, text: str) -> list[ToolCallDelta]:
        if self._whole is not None and not self.num_calls:
            self._seen += text
        out: list[ToolCallDelta] = []
        while text:
            if self._arguments_end is None:
                self._pending += text
                match = _JSON_CALL.search(self._pending)
                if match is None:
                    return out
                out.append(self._open(json.loads(match.group("name"))))
                text, self._pending = self._pending[match.end():], ""
                self._arguments_end = JsonObjectEnd()
            end = self._arguments_end.scan(text)
            out += self._arguments(text if end is None else text[:end])
            if end is None:
                return out
            self._arguments_end, text = None, text[end:]
        return out

    def end(self) -> list[ToolCallDelta] | None:
        if self.num_calls or self._whole is None:
            return super().end()
        calls = self._whole(self._seen)
        if calls is None:
            return None
        deltas = []
        for call in calls:
            opened = self._open(call.name, call.id)
            opened.arguments = call.arguments
            deltas.append(opened)
        return deltas


class WholeOutputCall(BlockReader):
    """A forced named ``tool_choice``: the output is the arguments of that one function."""

    def __init__(self, name: str, call_id: CallId | None = None):
        super().__init__(0, call_id)
        self.name = name

    def feed(self, text: str) -> list[ToolCallDelta]:
        if not text:
            return []
        out = [] if self.num_calls else [self._open(self.name)]
        return out + self._arguments(text)


_KIMI_CALL_HEADER = re.compile(r"<\|tool_call_begin\|>\s*(?P<id>[^<]+?)\s*<\|tool_call_argument_begin\|>")
_KIMI_CALL_END = "<|tool_call_end|>"


def kimi_function_name(call_id: str) -> str:
    """``functions.get_weather:0`` → ``get_weather``."""
    name = call_id.split(":", 1)[0]
    return name.split(".", 1)[1] if name.startswith("functions.") else name


class KimiSectionReader(BlockReader):
    """Kimi-K2's section: ``<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{...}
    <|tool_call_end|>`` repeated; the text between the markers is the id (which names the
    function) and the arguments (without surrounding whitespace)."""

    def __init__(self, first_index: int, call_id: CallId | None = None):
        super().__init__(first_index, call_id)
        self._pending = ""
        self._arguments_text: UntilMarker | None = None

    def feed(self, text: str) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        while text:
            if self._arguments_text is None:
                self._pending += text
                match = _KIMI_CALL_HEADER.search(self._pending)
                if match is None:
                    return out
                call_id = match.group("id")
                out.append(self._open(kimi_function_name(call_id), call_id))
                text, self._pending = self._pending[match.end():], ""
                self._arguments_text = UntilMarker(_KIMI_CALL_END, strip="space")
            passed, rest = self._arguments_text.feed(text)
            out += self._arguments(passed)
            if rest is None:
                return out
            self._arguments_text, text = None, rest
        return out


@dataclass(frozen=True)
class ParameterValue:
    """How one parameter's text becomes JSON: ``"string"`` streams it as a JSON string,
    ``"raw"`` streams it as written (it is JSON already), ``"converted"`` holds it until complete
    and writes ``convert(text)``. ``strip`` is :class:`UntilMarker`'s."""

    mode: str
    strip: str = ""
    convert: Callable[[str], Any] | None = None


class ElementCallsReader(BlockReader):
    """Calls written as markup elements — an opening tag that names the function, one element
    per parameter, a closing tag — passed on as a JSON object ``{"k": v, ...}`` while they
    arrive. A format gives its tags and how each parameter's value is written
    (:meth:`parameter_value`); Qwen3.5's XML and DeepSeek-V4's DSML are two such formats."""

    call_open: re.Pattern[str]  # group "name": the function
    call_end: str
    parameter_open: re.Pattern[str]  # group "name": the parameter
    parameter_end: str

    def __init__(self, first_index: int, call_id: CallId | None = None):
        super().__init__(first_index, call_id)
        self._pending = ""
        self._function: str | None = None
        self._num_parameters = 0
        self._value: UntilMarker | None = None
        self._value_rule = ParameterValue("string")
        self._value_text = ""  # a converted value, until it is complete

    @abstractmethod
    def parameter_value(self, function: str, parameter: re.Match[str]) -> ParameterValue:
        """How the value of ``parameter`` (its opening tag's match) of ``function`` is written."""

    def _value_piece(self, passed: str, complete: bool) -> str:
        rule = self._value_rule
        if rule.mode == "string":
            return json.dumps(passed, ensure_ascii=False)[1:-1] + ('"' if complete else "")
        if rule.mode == "raw":
            return passed
        self._value_text += passed
        return json.dumps(rule.convert(self._value_text), ensure_ascii=False) if complete else ""

    def feed(self, text: str) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        while text:
            if self._value is not None:
                passed, rest = self._value.feed(text)
                out += self._arguments(self._value_piece(passed, rest is not None))
                if rest is None:
                    return out
                self._value, text = None, rest
                continue
            self._pending += text
            text = ""
            if self._function is None:
                match = self.call_open.search(self._pending)
                if match is None:
                    return out
                self._function = match.group("name").strip()
                out.append(self._open(self._function))
                self._num_parameters = 0
                text, self._pending = self._pending[match.end():], ""
                continue
            parameter = self.parameter_open.search(self._pending)
            closing = self._pending.find(self.call_end)
            if closing >= 0 and (parameter is None or closing < parameter.start()):
                out += self._arguments("}" if self._num_parameters else "{}")
                self._function = None
                text, self._pending = self._pending[closing + len(self.call_end):], ""
            elif parameter is not None:
                self._value_rule = self.parameter_value(self._function, parameter)
                opening = "{" if self._num_parameters == 0 else ", "
                key = json.dumps(parameter.group("name").strip(), ensure_ascii=False)
                quote = '"' if self._value_rule.mode == "string" else ""
                out += self._arguments(f"{opening}{key}: {quote}")
                self._num_parameters += 1
                self._value = UntilMarker(self.parameter_end, strip=self._value_rule.strip)
                self._value_text = ""
                text, self._pending = self._pending[parameter.end():], ""
        return out


DSML = "｜DSML｜"


class DsmlReader(ElementCallsReader):
    """DeepSeek-V4's DSML: each ``invoke`` is a call, each ``parameter`` of it one argument; a
    ``string="true"`` value is a JSON string of the raw text, a ``string="false"`` one is JSON
    as written."""

    call_open = re.compile(rf'<{DSML}invoke name="(?P<name>[^"]+)">')
    call_end = f"</{DSML}invoke>"
    parameter_open = re.compile(rf'<{DSML}parameter name="(?P<name>[^"]+)" string="(?P<string>true|false)">')
    parameter_end = f"</{DSML}parameter>"

    def parameter_value(self, function: str, parameter: re.Match[str]) -> ParameterValue:
        if parameter.group("string") == "true":
            return ParameterValue("string")
        return ParameterValue("raw", strip="space")
