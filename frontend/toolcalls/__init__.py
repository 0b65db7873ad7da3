"""Tool calling on the text side: the model's own call format parsed out of its output, and the
grammar constraints that force a call (``tool_choice`` required or named).

* :mod:`.formats` — one :class:`~.formats.ToolCallFormat` per model family (Qwen3 / Qwen3.5
  ``<tool_call>`` JSON, Kimi-K2 section tokens, DeepSeek-V4 DSML); :func:`~.formats.detect_format`
  picks one from the tokenizer's vocabulary (the markers are tokens of that vocabulary).
* :mod:`.choice` — ``tool_choice`` / ``tools`` validation and the JSON Schema constraint that
  forces a call: ``required`` → a JSON array of ``{"name", "parameters"}`` objects (one of the
  declared tools each), a named function → that function's arguments object.
"""

from openinfer.frontend.toolcalls.choice import (
    ToolChoice,
    forced_call_constraint,
    parse_forced_calls,
    resolve_tool_choice,
)
from openinfer.frontend.toolcalls.formats import (
    FORMATS,
    ToolCall,
    ToolCallFormat,
    detect_format,
    new_call_id,
)

__all__ = ["FORMATS", "ToolCall", "ToolCallFormat", "ToolChoice", "detect_format", "forced_call_constraint",
           "new_call_id", "parse_forced_calls", "resolve_tool_choice"]
