"""A tool call, whole (non-streamed responses) and in pieces (streamed ``tool_calls`` deltas).

A streamed call is a sequence of :class:`ToolCallDelta` with one ``index``: the first names the
call (``id``, ``name``), the later ones carry fragments of its arguments as the model writes
them. Concatenating the fragments gives exactly the arguments of the whole call
(:func:`assemble_calls`), which is how the OpenAI clients accumulate a stream.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            call["index"] = index
        return call


@dataclass
class ToolCallDelta:
    """One piece of the call at ``index`` (the choice's calls are numbered from 0): the piece that
    opens it has ``id`` and ``name``, every piece may add ``arguments`` text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    @property
    def opens_call(self) -> bool:
        return self.id is not None

    def as_openai(self) -> dict[str, Any]:
        """The OpenAI stream's shape: id, type and name only on the opening piece."""
        if self.opens_call:
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, "function": {"arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def coalesce(deltas: Iterable[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive pieces of one call merged (one entry per call and chunk, as OpenAI sends them)."""
    merged: list[ToolCallDelta] = []
    for delta in deltas:
        if merged and merged[-1].index == delta.index and not delta.opens_call:
            last = merged[-1]
            merged[-1] = ToolCallDelta(last.index, last.id, last.name, last.arguments + delta.arguments)
        elif delta.opens_call or delta.arguments:
            merged.append(delta)
    return merged


def assemble_calls(deltas: Iterable[ToolCallDelta]) -> list[ToolCall]:
    """The whole calls a sequence of pieces describes, by index."""
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        if delta.opens_call:
            if delta.index in calls:
                raise ValueError(f"tool call {delta.index} is opened twice")
            calls[delta.index] = [delta.id or "", delta.name or "", delta.arguments]
        elif delta.index not in calls:
            raise ValueError(f"arguments for tool call {delta.index} before it was opened")
        else:
            calls[delta.index][2] += delta.arguments
    return [ToolCall(*calls[index]) for index in sorted(calls)]
