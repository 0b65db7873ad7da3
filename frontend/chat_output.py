"""A chat choice's generated text split into ``reasoning_content``, ``content`` and tool calls.

:class:`ChatOutputParser` is fed the choice's text deltas in order and returns what each adds.
Streamed and non-streamed responses feed it the very same deltas, and its decisions depend only
on whether a marker is complete in what it holds (a text that may still become a marker is
held back), so both give identical reasoning, content and calls. States::

    start ──<think>──▶ reasoning ──</think>──▶ content ──block start──▶ tool block ──block end──▶ gap
      └────(other text)────────────────────────▲   ▲─────────────(text after the whitespace)────────┘

Tool calls are emitted whole when their block closes (one OpenAI delta per call: id, name and
the complete arguments). A block cut by ``max_tokens`` or one that does not parse stays content.
With a forced ``tool_choice`` the output is the JSON of :mod:`openinfer.frontend.toolcalls.choice`
and is turned into calls at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from openinfer.frontend.reasoning import THINK_END, THINK_START, held_back
from openinfer.frontend.toolcalls import ToolCall, ToolCallFormat, ToolChoice, parse_forced_calls


@dataclass
class ParsedDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def merge(self, other: ParsedDelta) -> ParsedDelta:
        return ParsedDelta(self.reasoning + other.reasoning, self.content + other.content,
                           self.tool_calls + other.tool_calls)


class ChatOutputParser:
    def __init__(self, *, reasoning: bool = False, in_reasoning: bool = False,
                 tool_format: ToolCallFormat | None = None, forced: ToolChoice | None = None,
                 id_format: ToolCallFormat | None = None):
        """``id_format``: the model's format, which names forced calls (``tool_format`` is None then)."""
        self.tool_format = tool_format
        self.id_format = id_format
        self.forced = forced if forced is not None and forced.forced else None
        self.state = "reasoning" if reasoning and in_reasoning else ("start" if reasoning else "content")
        self.buffer = ""
        self.num_calls = 0
        self.forced_text = ""  # a forced call's JSON, read at the end

    def push(self, text: str) -> ParsedDelta:
        self.buffer += text
        out = ParsedDelta()
        while self._step(out):
            pass
        if self.forced is not None:  # the content is one JSON value (after any thought), read at the end
            self.forced_text += out.content
            out.content = ""
        return out

    def finish(self) -> ParsedDelta:
        """Whatever is held back, at the end of the choice."""
        out = ParsedDelta()
        while self._step(out):
            pass
        if self.state == "reasoning":
            out.reasoning += self.buffer
        elif self.state in ("start", "content", "tool"):
            out.content += self.buffer
        self.buffer = ""
        if self.forced is not None:
            text, out.content = self.forced_text + out.content, ""
            calls = parse_forced_calls(text, self.forced,
                                       self.id_format.call_id if self.id_format is not None else None)
            if calls is None:
                out.content = text  # cut short (max_tokens): the partial JSON is the content
            else:
                out.tool_calls = calls
        return out

    def _step(self, out: ParsedDelta) -> bool:
        """Advance the state machine once; False when it needs more text."""
        buffer = self.buffer
        if self.state == "start":
            stripped = buffer.lstrip()
            if stripped.startswith(THINK_START):
                self.buffer, self.state = stripped[len(THINK_START):], "reasoning"
                return True
            if not stripped or THINK_START.startswith(stripped):
                return False
            self.state = "content"
            return True
        if self.state == "reasoning":
            end = buffer.find(THINK_END)
            if end < 0:
                keep = held_back(buffer, THINK_END)
                out.reasoning += buffer[:len(buffer) - keep]
                self.buffer = buffer[len(buffer) - keep:]
                return False
            out.reasoning += buffer[:end]  # the content keeps what follows </think> as is (as vLLM and smg do)
            self.buffer, self.state = buffer[end + len(THINK_END):], "content"
            return True
        if self.state == "gap":  # whitespace after a tool block is not content
            stripped = buffer.lstrip()
            if not stripped:
                self.buffer = ""
                return False
            self.buffer, self.state = stripped, "content"
            return True
        if self.state == "content":
            if self.tool_format is None:
                out.content += buffer
                self.buffer = ""
                return False
            start = buffer.find(self.tool_format.start)
            if start < 0:
                keep = held_back(buffer, self.tool_format.start)
                out.content += buffer[:len(buffer) - keep]
                self.buffer = buffer[len(buffer) - keep:]
                return False
            out.content += buffer[:start]
            self.buffer, self.state = buffer[start:], "tool"
            return True
        # a tool block
        assert self.tool_format is not None
        end = buffer.find(self.tool_format.end)
        if end < 0:
            return False
        block_end = end + len(self.tool_format.end)
        calls = self.tool_format.parse(buffer[len(self.tool_format.start):end], self.num_calls)
        if calls is None:
            out.content += buffer[:block_end]
        else:
            out.tool_calls += calls
            self.num_calls += len(calls)
        self.buffer, self.state = buffer[block_end:], "gap"
        return True
