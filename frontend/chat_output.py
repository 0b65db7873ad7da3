"""A chat choice's generated text split into ``reasoning_content``, ``content`` and tool calls.

:class:`ChatOutputParser` is fed the choice's text deltas in order and returns what each adds.
Streamed and non-streamed responses feed it the very same deltas, and its decisions depend only
on whether a marker is complete in what it holds (a text that may still become a marker is
held back), so both give identical reasoning, content and calls. States::

    start ──<think>──▶ reasoning ──</think>──▶ content ──block start──▶ tool block ──block end──▶ gap
      └────(other text)────────────────────────▲   ▲─────────────(text after the whitespace)────────┘

A tool call opens (one delta: index, id, name) as soon as its block has shown its name, and its
arguments follow in fragments as the model writes them (see :mod:`openinfer.frontend.toolcalls.readers`);
a block that holds no call when it closes, or is cut by ``max_tokens`` before its first call
opened, stays content. With a forced ``tool_choice`` the content is the JSON of
:mod:`openinfer.frontend.toolcalls.choice`, read the same way; when it opened no call by the end
(cut short) it is returned as content.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from openinfer.frontend.reasoning import THINK_END, THINK_START, held_back
from openinfer.frontend.toolcalls import (
    BlockReader,
    ToolCall,
    ToolCallDelta,
    ToolCallFormat,
    ToolChoice,
    assemble_calls,
    coalesce,
    forced_call_reader,
)
from openinfer.frontend.toolcalls.qwen_xml import ParameterTypes


@dataclass
class ParsedDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def merge(self, other: ParsedDelta) -> ParsedDelta:
        return ParsedDelta(self.reasoning + other.reasoning, self.content + other.content,
                           self.tool_calls + other.tool_calls)

    def calls(self) -> list[ToolCall]:
        """The whole calls (for a response that is not streamed: every delta merged)."""
        return assemble_calls(self.tool_calls)


class ChatOutputParser:
    def __init__(self, *, reasoning: bool = False, in_reasoning: bool = False,
                 tool_format: ToolCallFormat | None = None, forced: ToolChoice | None = None,
                 id_format: ToolCallFormat | None = None, parameter_types: ParameterTypes | None = None):
        """``id_format``: the model's format, which names forced calls (``tool_format`` is None then);
        ``parameter_types``: the declared tools' parameter types (formats that write values as text)."""
        self.tool_format = tool_format
        self.parameter_types = parameter_types
        self.state = "reasoning" if reasoning and in_reasoning else ("start" if reasoning else "content")
        self.buffer = ""
        self.num_calls = 0  # in the blocks closed so far
        self.block: BlockReader | None = None  # the open block's reader
        self.block_text = ""  # the open block's text fed so far (content again if it holds no call)
        self.forced: BlockReader | None = None
        if forced is not None and forced.forced:
            self.forced = forced_call_reader(forced, id_format.call_id if id_format is not None else None)
        self.forced_text = ""  # a forced call's output, content again if it opens no call

    def push(self, text: str) -> ParsedDelta:
        self.buffer += text
        out = ParsedDelta()
        while self._step(out):
            pass
        return self._read_forced(out)

    def finish(self) -> ParsedDelta:
        """Whatever is held back, at the end of the choice."""
        out = ParsedDelta()
        while self._step(out):
            pass
        if self.state == "reasoning":
            out.reasoning += self.buffer
        elif self.state in ("start", "content"):
            out.content += self.buffer
        elif self.state == "tool":
            assert self.block is not None and self.tool_format is not None
            if not self.block.num_calls:  # cut before a call opened: the block is text
                out.content += self.tool_format.start + self.block_text + self.buffer
            # else the call stays as far as it came (a partial end marker held back is dropped)
        self.buffer = ""
        out = self._read_forced(out)
        if self.forced is not None:
            closing = self.forced.end()
            if closing is None:
                out.content = self.forced_text
            else:
                out.tool_calls = coalesce(out.tool_calls + closing)
        return out

    def _read_forced(self, out: ParsedDelta) -> ParsedDelta:
        """A forced call's output goes to its reader instead of the content."""
        if self.forced is not None and out.content:
            self.forced_text += out.content
            out.tool_calls += self.forced.feed(out.content)
            out.content = ""
        out.tool_calls = coalesce(out.tool_calls)
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
            self.buffer, self.state = buffer[start + len(self.tool_format.start):], "tool"
            self.block = self.tool_format.reader(self.num_calls, self.tool_format.call_id, self.parameter_types)
            self.block_text = ""
            return True
        # a tool block: its reader gets the text before the end marker
        assert self.tool_format is not None and self.block is not None
        end = buffer.find(self.tool_format.end)
        body = buffer[:end] if end >= 0 else buffer[:len(buffer) - held_back(buffer, self.tool_format.end)]
        self.block_text += body
        out.tool_calls += self.block.feed(body)
        if end < 0:
            self.buffer = buffer[len(body):]
            return False
        closing = self.block.end()
        if closing is None:
            out.content += self.tool_format.start + self.block_text + self.tool_format.end
        else:
            out.tool_calls += closing
            self.num_calls += self.block.num_calls
        self.buffer, self.state, self.block = buffer[end + len(self.tool_format.end):], "gap", None
        return True
