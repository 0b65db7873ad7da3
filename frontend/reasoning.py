"""Reasoning ("thinking") markers and where a generation starts relative to them.

The families openinfer serves think between ``<think>`` and ``</think>`` (Qwen3, Kimi-K2-Thinking,
DeepSeek-V4 thinking mode). Their chat templates differ in where the opening tag goes:

* Qwen3 (hybrid) lets the model write ``<think>`` itself, or, with ``enable_thinking: false``,
  closes an empty block in the prompt;
* DeepSeek-V4 in thinking mode (and Qwen3-Thinking-2507) end the prompt with ``<think>``, so the
  output starts inside the reasoning and only the closing tag is generated;
* Kimi-K2-Thinking always writes ``<think>…</think>`` first.

:func:`starts_in_reasoning` reads the rendered prompt: the generation starts inside a thought
when the prompt's last ``<think>`` is not closed. Everything before ``</think>`` is then
``reasoning_content``; a thought cut by ``max_tokens`` is reasoning only.
"""

from __future__ import annotations

from openinfer.tokenizer import Tokenizer

THINK_START = "<think>"
THINK_END = "</think>"


def supports_reasoning(tokenizer: Tokenizer) -> bool:
    """Whether the vocabulary has the think markers (then chat output is split)."""
    return tokenizer.raw.token_to_id(THINK_START) is not None and tokenizer.raw.token_to_id(THINK_END) is not None


def starts_in_reasoning(prompt_text: str) -> bool:
    opened = prompt_text.rfind(THINK_START)
    return opened >= 0 and opened > prompt_text.rfind(THINK_END)


def held_back(text: str, marker: str) -> int:
    """Length of the longest proper suffix of ``text`` that begins ``marker`` (it may still
    become the marker with the next text, so it is not emitted yet)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
