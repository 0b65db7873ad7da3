"""Tool calling on the text side: the model's own call format parsed out of its output, and the
grammar constraints that force a call (``tool_choice`` required or named).

* :mod:`.formats` — one :class:`~.formats.ToolCallFormat` per model family (``<tool_call>``
  blocks of Qwen3 JSON or Qwen3.5 XML, Kimi-K2 section tokens, DeepSeek-V4 DSML); :func:`~.formats.detect_format`
  picks one from the tokenizer's vocabulary (the markers are tokens of that vocabulary).
* :mod:`.calls` — a call whole (:class:`~.calls.ToolCall`) and in streamed pieces
  (:class:`~.calls.ToolCallDelta`); :mod:`.readers` — the incremental readers that open each
  call when its name is complete and stream its arguments as the model writes them; :mod:`.qwen_xml` —
  Qwen3.5's XML calls (values typed by the declared parameters).
* :mod:`.choice` — ``tool_choice`` / ``tools`` validation and the JSON Schema constraint that
  forces a call: ``required`` → a JSON array of ``{"name", "parameters"}`` objects (one of the
  declared tools each), a named function → that function's arguments object.
"""

from openinfer.frontend.toolcalls.calls import ToolCall, ToolCallDelta, assemble_calls, coalesce, new_call_id
from openinfer.frontend.toolcalls.choice import (
    ToolChoice,
    forced_call_constraint,
    forced_call_reader,
    resolve_tool_choice,
)
from openinfer.frontend.toolcalls.formats import FORMATS, ToolCallFormat, detect_format
from openinfer.frontend.toolcalls.readers import BlockReader

__all__ = ["FORMATS", "BlockReader", "ToolCall", "ToolCallDelta", "ToolCallFormat", "ToolChoice", "assemble_calls",
           "coalesce", "detect_format", "forced_call_constraint", "forced_call_reader", "new_call_id",
           "resolve_tool_choice"]
