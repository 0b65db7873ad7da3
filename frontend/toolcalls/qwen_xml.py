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
from openinfer.frontend.toolcalls.readers import (
    BlockReader,
    CallId,
    ElementCallsReader,
    JsonCallsReader,
    ParameterValue,
)

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


class XmlCallsReader(ElementCallsReader):
    """Qwen3.5 (and Qwen3-Coder): ``<function=f>`` then ``<parameter=k>\\nvalue\\n</parameter>``
    lines then ``</function>``. A parameter declared a string (or not declared) streams as a JSON
    string of its text; any other is converted by its declared type when its value is complete."""

    call_open = re.compile(r"<function=(?P<name>[^>\n]+)>")
    call_end = "</function>"
    parameter_open = re.compile(r"<parameter=(?P<name>[^>\n]+)>")
    parameter_end = "</parameter>"

    def __init__(self, first_index: int, call_id: CallId | None = None, types: ParameterTypes | None = None):
        super().__init__(first_index, call_id)
        self._types = types or {}

    def parameter_value(self, function: str, parameter: re.Match[str]) -> ParameterValue:
        kind = self._types.get(function, {}).get(parameter.group("name").strip(), "string")
        if kind == "string":
            return ParameterValue("string", strip="newline")
        return ParameterValue("converted", strip="newline", convert=lambda text: xml_parameter_value(text, kind))


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
