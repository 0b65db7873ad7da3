"""The DeepSeek-V4 chat encoding (the checkpoint ships no Jinja template; DeepSeek publishes
``encoding/encoding_dsv4.py`` instead). Served through the ``openinfer_chat_encoder`` hook.

Wire format, one string (special tokens spelled out; the tokenizer maps them to ids)::

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜>
    <｜User｜>{user}<｜Assistant｜><think>                      ← generation prompt, thinking mode

- chat mode: every assistant turn opens with ``</think>`` (an empty thought);
- thinking mode: the turn after the *last* user message opens with ``<think>``; earlier
  assistant turns lose their reasoning (``drop_thinking``, the default) and open with
  ``</think>``; an assistant message after the last user message (a prefilled reply) keeps
  ``reasoning_content + </think>`` before its content;
- consecutive user-side messages form one user turn, parts separated by blank lines; tool
  results (role ``tool``) are ``<tool_result>…</tool_result>`` parts of it; assistant tool calls are a ``<｜DSML｜tool_calls>`` block of
  ``<｜DSML｜invoke name=…>`` with one ``<｜DSML｜parameter name=… string="true|false">`` per
  argument (strings as is, everything else as JSON);
- tool schemas go into the system prompt under ``## Tools`` (our wording, not DeepSeek's).

Options (``chat_template_kwargs``): ``thinking`` (bool; ``enable_thinking`` and
``thinking_mode="thinking"|"chat"`` are accepted too), ``drop_thinking`` (bool, default true).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from openinfer import InvalidRequestError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
END_THINK = "</think>"
DSML = "｜DSML｜"
_RESERVED = (BOS, EOS, USER, ASSISTANT, DSML)


def _text(value: Any, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidRequestError(f"{where} must be a string for DeepSeek-V4 chat", "messages")
    for token in _RESERVED:
        if token in value:
            raise InvalidRequestError(f"{where} contains the reserved DeepSeek-V4 token {token!r}", "messages")
    return value


def _tool_calls_block(calls: Sequence[Mapping[str, Any]], where: str) -> str:
    invokes = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not function.get("name"):
            raise InvalidRequestError(f"{where}.tool_calls[{i}] needs function.name and function.arguments",
                                      "messages")
        arguments = function.get("arguments") or "{}"
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else dict(arguments)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"{where}.tool_calls[{i}].function.arguments is not a JSON object: {exc}",
                                      "messages") from exc
        if not isinstance(arguments, dict):
            raise InvalidRequestError(f"{where}.tool_calls[{i}].function.arguments must be a JSON object",
                                      "messages")
        parameters = []
        for key, value in arguments.items():
            is_string = isinstance(value, str)
            rendered = _text(value, where) if is_string else json.dumps(value, ensure_ascii=False)
            parameters.append(f'<{DSML}parameter name="{key}" string="{"true" if is_string else "false"}">'
                              f"{rendered}</{DSML}parameter>")
        invokes.append(f'<{DSML}invoke name="{_text(function["name"], where)}">\n' + "\n".join(parameters)
                       + f"\n</{DSML}invoke>")
    return f"\n\n<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n</{DSML}tool_calls>"


def _tools_section(tools: Sequence[Mapping[str, Any]]) -> str:
    schemas = []
    for tool in tools:
        function = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not function.get("name"):
            raise InvalidRequestError("every tool needs a function with a name", "tools")
        schemas.append(json.dumps(dict(function), ensure_ascii=False))
    return ("## Tools\n\nCall tools with a <" + DSML + "tool_calls> block holding one <" + DSML
            + "invoke name=\"…\"> per call and one <" + DSML + "parameter name=\"…\" string=\"true|false\"> "
            "per argument (strings as is with string=\"true\", other values as JSON with string=\"false\"). "
            "In thinking mode, reason inside " + THINK + "…" + END_THINK + " first.\n\n"
            "### Available Tool Schemas\n\n" + "\n".join(schemas))


def _thinking_mode(options: Mapping[str, Any]) -> bool:
    mode = options.get("thinking_mode")
    if mode is not None:
        if mode not in ("thinking", "chat"):
            raise InvalidRequestError(f"thinking_mode must be 'thinking' or 'chat', got {mode!r}",
                                      "chat_template_kwargs")
        return mode == "thinking"
    return bool(options.get("thinking", options.get("enable_thinking", False)))


class DeepseekV4ChatEncoder:
    """``openinfer.tokenizer.ChatEncoder`` for DeepSeek-V4."""

    def encode(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **options: Any) -> str:
        thinking = _thinking_mode(options)
        drop_thinking = bool(options.get("drop_thinking", True)) and not tools
        turns = self._turns(messages, tools)
        last_user = max((i for i, t in enumerate(turns) if t["role"] == "user"), default=-1)
        prompt = BOS
        for i, turn in enumerate(turns):
            following = turns[i + 1]["role"] if i + 1 < len(turns) else None
            if turn["role"] == "system":
                prompt += turn["content"]
            elif turn["role"] == "user":
                prompt += USER + "\n\n".join(turn["parts"])
                if following == "assistant" or (following is None and add_generation_prompt):
                    opens_thought = thinking and (not drop_thinking or i >= last_user)
                    prompt += ASSISTANT + (THINK if opens_thought else END_THINK)
            else:  # assistant
                if thinking and (not drop_thinking or i > last_user):
                    prompt += turn["reasoning"] + END_THINK
                prompt += turn["content"] + turn["tool_calls"] + EOS
        return prompt

    @staticmethod
    def _turns(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> list[dict]:
        """Messages as system / user (text and tool-result parts) / assistant turns."""
        turns: list[dict[str, Any]] = []
        for i, message in enumerate(messages):
            where = f"messages[{i}]"
            role = message.get("role")
            content = _text(message.get("content"), f"{where}.content")
            if role in ("system", "developer") and not any(t["role"] != "system" for t in turns):
                turns.append({"role": "system", "content": content})
            elif role in ("user", "developer", "system", "tool"):  # a late system message speaks as the user
                part = f"<tool_result>{content}</tool_result>" if role == "tool" else content
                if turns and turns[-1]["role"] == "user":  # consecutive user-side messages form one turn
                    turns[-1]["parts"].append(part)
                else:
                    turns.append({"role": "user", "parts": [part]})
            elif role == "assistant":
                calls = message.get("tool_calls") or []
                turns.append({"role": "assistant", "content": content,
                              "reasoning": _text(message.get("reasoning_content"), f"{where}.reasoning_content"),
                              "tool_calls": _tool_calls_block(calls, where) if calls else ""})
            else:
                raise InvalidRequestError(f"{where}.role {role!r} is not a DeepSeek-V4 chat role", "messages")
        if tools:
            section = _tools_section(tools)
            if turns and turns[0]["role"] == "system":
                turns[0]["content"] += "\n\n" + section
            else:
                turns.insert(0, {"role": "system", "content": section})
        return turns
