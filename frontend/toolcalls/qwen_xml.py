"""Qwen3.5's (and Qwen3-Coder's) XML tool calls, read incrementally, and the ``<tool_call>``
block reader that tells them from Qwen3's JSON calls.

Qwen3.5 writes each call as ``<function=f>``, then one ``<parameter=k>`` element per argument
whose value is plain text on its own lines, then ``</function>``. The text has no types: a value
is converted by the type the request's tool declares for that parameter (as vLLM's qwen3_coder
parser does), so the readers need the declared types (:func:`parameter_types`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from openinfer.frontend.toolcalls.calls import ToolCall, ToolCallDelta
from openinfer.frontend.toolcalls.readers import BlockReader, CallId, JsonCallsReader, UntilMarker

ParameterTypes = Mapping[str, Mapping[str, str]]  # function → parameter → its JSON Schema type


def parameter_types(functions: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, str]]:
    """The declared type of each function's parameters (``tools[].function``, by name)."""
    types: dict[str, dict[str, str]] = {}
    for name, function in functions.items():
        properties = (function.get("parameters") or {}).get("properties") or {}
        for key, schema in properties.items():
            kind = schema.get("type") if isinstance(schema, Mapping) else None
            if isinstance(kind, list):  # ["integer", "null"] → integer
                kind = next((k for k in kind if k != "null"), None)
            if isinstance(kind, str):
                types.setdefault(name, {})[key] = kind
    return types


def xml_parameter_value(text: str, kind: str) -> Any:
    """A Qwen3.5 parameter's text as the JSON value its declared type says (the text itself when
    it does not read as that type, as vLLM's qwen3_coder parser does)."""
    try:
        if kind == "integer":
            return int(text.strip())
        if kind == "number":
            number = float(text.strip())
            return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number
        if kind == "boolean" and text.strip().lower() in ("true", "false"):
            return text.strip().lower() == "true"
        if kind == "null" and text.strip() == "null":
            return None
        if kind in ("object", "array"):
            return json.loads(text)
    except ValueError:
        pass
    return text


_XML_FUNCTION = re.compile(r"<function=(?P<name>[^>\n]+)>")
_XML_PARAMETER = re.compile(r"<parameter=(?P<name>[^>\n]+)>")
_XML_FUNCTION_END = "</function>"
_XML_PARAMETER_END = "</parameter>"


class XmlCallsReader(BlockReader):
    """Qwen3.5 (and Qwen3-Coder): ``<function=f>`` then ``<parameter=k>\\nvalue\\n</parameter>``
    lines then ``</function>``, written as a JSON object while it arrives. A parameter declared a
    string (or not declared) streams as a JSON string of its text; any other is converted by its
    declared type when its value is complete."""

    def __init__(self, first_index: int, call_id: CallId | None = None, types: ParameterTypes | None = None):
        super().__init__(first_index, call_id)
        self._types = types or {}
        self._pending = ""
        self._function: str | None = None
        self._num_parameters = 0
        self._value: UntilMarker | None = None
        self._value_kind = "string"
        self._value_text = ""  # a non-string value, until it is complete

    def feed(self, text: str) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        while text:
            if self._value is not None:
                passed, rest = self._value.feed(text)
                if self._value_kind == "string":
                    out += self._arguments(json.dumps(passed, ensure_ascii=False)[1:-1] + ('"' if rest is not None
                                                                                          else ""))
                else:
                    self._value_text += passed
                    if rest is not None:
                        value = xml_parameter_value(self._value_text, self._value_kind)
                        out += self._arguments(json.dumps(value, ensure_ascii=False))
                if rest is None:
                    return out
                self._value, text = None, rest
                continue
            self._pending += text
            text = ""
            if self._function is None:
                match = _XML_FUNCTION.search(self._pending)
                if match is None:
                    return out
                self._function = match.group("name").strip()
                out.append(self._open(self._function))
                self._num_parameters = 0
                text, self._pending = self._pending[match.end():], ""
                continue
            parameter = _XML_PARAMETER.search(self._pending)
            closing = self._pending.find(_XML_FUNCTION_END)
            if closing >= 0 and (parameter is None or closing < parameter.start()):
                out += self._arguments("}" if self._num_parameters else "{}")
                self._function = None
                text, self._pending = self._pending[closing + len(_XML_FUNCTION_END):], ""
            elif parameter is not None:
                key = parameter.group("name").strip()
                self._value_kind = self._types.get(self._function, {}).get(key, "string")
                opening = "{" if self._num_parameters == 0 else ", "
                quote = '"' if self._value_kind == "string" else ""
                out += self._arguments(f"{opening}{json.dumps(key, ensure_ascii=False)}: {quote}")
                self._num_parameters += 1
                self._value, self._value_text = UntilMarker(_XML_PARAMETER_END, strip="newline"), ""
                text, self._pending = self._pending[parameter.end():], ""
        return out


class QwenBlockReader(BlockReader):
    """A ``<tool_call>`` block: Qwen3's JSON (``{"name": ..., "arguments": ...}``) or Qwen3.5's
    XML (``<function=...>``), told apart by the block's first non-blank character."""

    def __init__(self, first_index: int, call_id: CallId | None = None, types: ParameterTypes | None = None,
                 whole: Callable[[str], list[ToolCall] | None] | None = None):
        super().__init__(first_index, call_id)
        self._make = lambda xml: (XmlCallsReader(first_index, call_id, types) if xml
                                  else JsonCallsReader(first_index, call_id, whole))
        self._reader: BlockReader | None = None
        self._pending = ""

    @property
    def num_calls(self) -> int:
        return self._reader.num_calls if self._reader is not None else 0

    def feed(self, text: str) -> list[ToolCallDelta]:
        if self._reader is None:
            self._pending += text
            stripped = self._pending.lstrip()
            if not stripped:
                return []
            self._reader, text = self._make(stripped.startswith("<")), self._pending
        return self._reader.feed(text)

    def end(self) -> list[ToolCallDelta] | None:
        if self._reader is None:
            return None
        return self._reader.end()
