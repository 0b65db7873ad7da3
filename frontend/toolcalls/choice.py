"""``tools`` and ``tool_choice`` as the OpenAI API defines them, and the grammar that forces a call.

``auto`` leaves the model free and parses its own call format; ``none`` parses nothing;
``required`` and a named function are *enforced*: the request carries a JSON Schema constraint
(as vLLM and the smg router do, so outputs agree whichever frontend built the request):

* ``required`` → ``[{"name": <a declared tool>, "parameters": <its arguments>}, ...]`` with at
  least one item (exactly one when ``parallel_tool_calls`` is false);
* ``{"type": "function", "function": {"name": "f"}}`` → the arguments object of ``f``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from openinfer.errors import InvalidRequestError
from openinfer.frontend.toolcalls.readers import BlockReader, CallId, JsonCallsReader, WholeOutputCall
from openinfer.structured import check_constraint
from openinfer.v1 import engine_pb2 as pb

ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "named"
    function: str | None = None

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


def _function_of(tool: Any, index: int) -> Mapping[str, Any]:
    if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
        raise InvalidRequestError(f"tools[{index}] must be {{'type': 'function', 'function': {{...}}}}", "tools")
    function = tool.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or not function["name"]:
        raise InvalidRequestError(f"tools[{index}].function must have a non-empty string 'name'", "tools")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, Mapping):
        raise InvalidRequestError(f"tools[{index}].function.parameters must be a JSON Schema object", "tools")
    return function


def tool_functions(tools: Sequence[Any] | None) -> dict[str, Mapping[str, Any]]:
    """name → function definition; raises for malformed tools, duplicate names and invalid schemas."""
    functions: dict[str, Mapping[str, Any]] = {}
    for index, tool in enumerate(tools or []):
        function = _function_of(tool, index)
        name = function["name"]
        if name in functions:
            raise InvalidRequestError(f"tools[{index}]: the function name {name!r} is declared twice", "tools")
        if function.get("parameters") is not None:
            try:
                check_constraint(pb.StructuredOutput(json_schema=json.dumps(function["parameters"])))
            except InvalidRequestError as exc:
                raise InvalidRequestError(f"tools[{index}] ({name}) parameters: {exc}", "tools") from exc
        functions[name] = function
    return functions


def resolve_tool_choice(tools: Sequence[Any] | None, tool_choice: Any) -> ToolChoice:
    functions = tool_functions(tools)
    if tool_choice is None:
        return ToolChoice("auto" if functions else "none")
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise InvalidRequestError(f"tool_choice must be 'none', 'auto', 'required' or a named function, "
                                      f"got {tool_choice!r}", "tool_choice")
        if tool_choice != "none" and not functions:
            raise InvalidRequestError(f"tool_choice {tool_choice!r} needs tools; declare at least one", "tool_choice")
        return ToolChoice(tool_choice)
    name = None
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str):
        raise InvalidRequestError("a named tool_choice is {'type': 'function', 'function': {'name': ...}}",
                                  "tool_choice")
    if name not in functions:
        raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the declared tools "
                                  f"{sorted(functions)}", "tool_choice")
    return ToolChoice("named", name)


def forced_call_schema(tools: Sequence[Any], choice: ToolChoice, parallel_tool_calls: bool) -> dict[str, Any]:
    functions = tool_functions(tools)
    if choice.mode == "named":
        return dict(functions[choice.function].get("parameters") or ANY_OBJECT)
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [name]},
                             "parameters": dict(function.get("parameters") or ANY_OBJECT)},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, function in functions.items()]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def forced_call_constraint(tools: Sequence[Any], choice: ToolChoice,
                           parallel_tool_calls: bool = True) -> pb.StructuredOutput | None:
    if not choice.forced:
        return None
    return pb.StructuredOutput(json_schema=json.dumps(forced_call_schema(tools, choice, parallel_tool_calls)))


def forced_call_reader(choice: ToolChoice, call_id: CallId | None = None) -> BlockReader:
    """A reader of an output generated under :func:`forced_call_constraint`: each call opens as
    soon as its name is known and its arguments stream as written. ``call_id(name, index)`` names
    each call."""
    if choice.mode == "named":
        return WholeOutputCall(choice.function or "", call_id)
    return JsonCallsReader(0, call_id)
