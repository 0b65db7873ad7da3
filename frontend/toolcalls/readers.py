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


DSML = "｜DSML｜"
_DSML_INVOKE = re.compile(rf'<{DSML}invoke name="(?P<name>[^"]+)">')
_DSML_PARAMETER = re.compile(rf'<{DSML}parameter name="(?P<name>[^"]+)" string="(?P<string>true|false)">')
_DSML_INVOKE_END = f"</{DSML}invoke>"
_DSML_PARAMETER_END = f"</{DSML}parameter>"


class DsmlReader(BlockReader):
    """DeepSeek-V4's DSML: each ``invoke`` is a call, each ``parameter`` of it one argument,
    written as a JSON object ``{"k": v, ...}`` while it arrives: a ``string="true"`` value is a
    JSON string of the raw text, a ``string="false"`` one is JSON as written."""

    def __init__(self, first_index: int, call_id: CallId | None = None):
        super().__init__(first_index, call_id)
        self._pending = ""
        self._in_invoke = False
        self._num_parameters = 0
        self._value: UntilMarker | None = None
        self._value_is_string = False

    def feed(self, text: str) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        while text:
            if self._value is not None:
                passed, rest = self._value.feed(text)
                if self._value_is_string:
                    passed = json.dumps(passed, ensure_ascii=False)[1:-1]
                    if rest is not None:
                        passed += '"'
                out += self._arguments(passed)
                if rest is None:
                    return out
                self._value, text = None, rest
                continue
            self._pending += text
            text = ""
            if not self._in_invoke:
                match = _DSML_INVOKE.search(self._pending)
                if match is None:
                    return out
                out.append(self._open(match.group("name")))
                self._in_invoke, self._num_parameters = True, 0
                text, self._pending = self._pending[match.end():], ""
                continue
            parameter = _DSML_PARAMETER.search(self._pending)
            closing = self._pending.find(_DSML_INVOKE_END)
            if closing >= 0 and (parameter is None or closing < parameter.start()):
                out += self._arguments("}" if self._num_parameters else "{}")
                self._in_invoke = False
                text, self._pending = self._pending[closing + len(_DSML_INVOKE_END):], ""
            elif parameter is not None:
                self._value_is_string = parameter.group("string") == "true"
                opening = "{" if self._num_parameters == 0 else ", "
                key = json.dumps(parameter.group("name"), ensure_ascii=False)
                out += self._arguments(f'{opening}{key}: {chr(34) if self._value_is_string else ""}')
                self._num_parameters += 1
                self._value = UntilMarker(_DSML_PARAMETER_END, strip="" if self._value_is_string else "space")
                text, self._pending = self._pending[parameter.end():], ""
        return out

