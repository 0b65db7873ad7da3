"""The tool-call formats of the model families openinfer serves, as text.

Each format writes calls in *blocks* between a start and an end marker; a block holds one or
more calls. Text outside blocks is the message content. The markers (special tokens of the
model's vocabulary) reach the parser because chat requests with a parser are detokenized with
``skip_special_tokens=False``.

=========  ========================================================================================
qwen3      ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`` (Qwen3, one call per
           block) or ``<tool_call>\\n<function=f>\\n<parameter=k>\\nv\\n</parameter>\\n</function>\\n
           </tool_call>`` (Qwen3.5, Qwen3-Coder: values typed by the tool's declared parameters)
kimi_k2    ``<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>
           {...}<|tool_call_end|>...<|tool_calls_section_end|>``
deepseek   ``<｜DSML｜tool_calls>\\n<｜DSML｜invoke name="f">\\n<｜DSML｜parameter name="k"
_v4        string="true">v</｜DSML｜parameter>\\n</｜DSML｜invoke>\\n</｜DSML｜tool_calls>``
           (``string="false"`` values are JSON)
=========  ========================================================================================
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from openinfer.frontend.toolcalls.calls import ToolCall, new_call_id
from openinfer.frontend.toolcalls.qwen_xml import ParameterTypes, QwenBlockReader
from openinfer.frontend.toolcalls.readers import (
    DSML,
    BlockReader,
    CallId,
    DsmlReader,
    KimiSectionReader,
    kimi_function_name,
)
from openinfer.tokenizer import Tokenizer


def _arguments_text(arguments: Any) -> str | None:
    """Arguments as JSON object text, or None when they are not an object."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return json.dumps(arguments, ensure_ascii=False)


@dataclass(frozen=True)
class ToolCallFormat:
    """``reader(first_index, call_id, parameter_types)`` reads one block as it is generated
    (streamed calls); ``parse(block_body, first_index)`` reads a whole block written in the
    format's JSON form (the calls, or None when it holds none)."""

    name: str
    start: str
    end: str
    parse: Callable[[str, int], list[ToolCall] | None]
    reader: Callable[[int, CallId | None, ParameterTypes | None], BlockReader]
    # the id a call gets when the frontend makes it (forced tool_choice): Kimi-K2's templates and
    # parsers read "functions.<name>:<index>", the others take any unique id
    call_id: Callable[[str, int], str] = lambda name, index: new_call_id()


def _parse_qwen3(body: str, first_index: int) -> list[ToolCall] | None:
    try:
        call = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = _arguments_text(call.get("arguments", call.get("parameters", {})))
    if arguments is None:
        return None
    return [ToolCall(new_call_id(), call["name"], arguments)]


_KIMI_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*(?P<id>[^<]+?)\s*<\|tool_call_argument_begin\|>(?P<args>.*?)\s*<\|tool_call_end\|>",
    re.DOTALL)


def _parse_kimi(body: str, first_index: int) -> list[ToolCall] | None:
    calls = []
    for match in _KIMI_CALL.finditer(body):
        call_id = match.group("id").strip()
        name = kimi_function_name(call_id)
        arguments = _arguments_text(match.group("args"))
        if not name or arguments is None:
            return None
        calls.append(ToolCall(call_id, name, arguments))
    return calls or None


_DSML_INVOKE = re.compile(rf'<{DSML}invoke name="(?P<name>[^"]+)">\n?(?P<params>.*?)</{DSML}invoke>', re.DOTALL)
_DSML_PARAMETER = re.compile(
    rf'<{DSML}parameter name="(?P<name>[^"]+)" string="(?P<string>true|false)">(?P<value>.*?)</{DSML}parameter>',
    re.DOTALL)


def _parse_dsml(body: str, first_index: int) -> list[ToolCall] | None:
    calls = []
    for invoke in _DSML_INVOKE.finditer(body):
        arguments: dict[str, Any] = {}
        for parameter in _DSML_PARAMETER.finditer(invoke.group("params")):
            value = parameter.group("value")
            if parameter.group("string") == "false":
                try:
                    value = json.loads(value)
                except json.JSONDecodeError:
                    return None
            arguments[parameter.group("name")] = value
        calls.append(ToolCall(new_call_id(), invoke.group("name"), json.dumps(arguments, ensure_ascii=False)))
    return calls or None


def dsml_arguments(arguments: Mapping[str, Any]) -> str:
    """Arguments as DSML parameter lines (strings raw, other values as JSON), as DeepSeek-V4 writes them."""
    lines = []
    for key, value in arguments.items():
        is_string = isinstance(value, str)
        text = value if is_string else json.dumps(value, ensure_ascii=False)
        lines.append(f'<{DSML}parameter name="{key}" string="{"true" if is_string else "false"}">{text}'
                     f'</{DSML}parameter>')
    return "\n".join(lines)


def _qwen3_reader(first_index: int, call_id: CallId | None, types: ParameterTypes | None) -> BlockReader:
    return QwenBlockReader(first_index, call_id, types, whole=lambda body: _parse_qwen3(body, first_index))


FORMATS: dict[str, ToolCallFormat] = {
    "qwen3": ToolCallFormat("qwen3", "<tool_call>", "</tool_call>", _parse_qwen3, _qwen3_reader),
    "kimi_k2": ToolCallFormat("kimi_k2", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", _parse_kimi,
                              lambda first_index, call_id, types: KimiSectionReader(first_index, call_id),
                              lambda name, index: f"functions.{name}:{index}"),
    "deepseek_v4": ToolCallFormat("deepseek_v4", f"<{DSML}tool_calls>", f"</{DSML}tool_calls>", _parse_dsml,
                                  lambda first_index, call_id, types: DsmlReader(first_index, call_id)),
}
# model_type (config.json) → format, for models whose tokenizer does not give it away
MODEL_TYPE_FORMATS = {"qwen3": "qwen3", "qwen3_moe": "qwen3", "qwen3_5": "qwen3", "qwen3_5_moe": "qwen3",
                      "kimi_k2": "kimi_k2", "deepseek_v4": "deepseek_v4"}


def _has_token(tokenizer: Tokenizer, text: str) -> bool:
    return tokenizer.raw.token_to_id(text) is not None


def detect_format(tokenizer: Tokenizer, model_type: str = "") -> ToolCallFormat | None:
    """The format whose markers this tokenizer carries (the chat template for DSML, which is
    text), else the model type's; None when neither tells."""
    if _has_token(tokenizer, "<|tool_calls_section_begin|>"):
        return FORMATS["kimi_k2"]
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else json.dumps(
        tokenizer.chat_template or "")
    if DSML in template or _has_token(tokenizer, f"<{DSML}tool_calls>"):
        return FORMATS["deepseek_v4"]
    if _has_token(tokenizer, "<tool_call>"):
        return FORMATS["qwen3"]
    name = MODEL_TYPE_FORMATS.get(model_type)
    return FORMATS[name] if name else None
