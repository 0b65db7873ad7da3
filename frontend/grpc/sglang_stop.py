"""Stop strings on the worker side of the SGLang protocol.

The router trims the text at a stop string itself, but only the worker can stop *generating*:
without this the engine would run on to ``max_new_tokens`` after the text was already cut.
The watcher decodes the generated ids incrementally and reports the id that completed a stop
string; the servicer then ends the request with ``finish_reason="stop"`` and
``matched_stop_str``, keeping the ids up to and including that one (SGLang does the same, so the
router's own trimming gives identical text).
"""

from __future__ import annotations

from collections.abc import Sequence

from openinfer.tokenizer import Tokenizer


class StopStringWatcher:
    """Finds the first stop string in the text of the generated ids.

    Invariant: ``tail`` is the end of the decoded text, long enough (the longest stop string
    minus one character) that a stop string spanning two token deltas is still found.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], stop_strings: Sequence[str],
                 skip_special_tokens: bool = True, min_tokens: int = 0):
        self.stop_strings = [s for s in stop_strings if s]
        self.min_tokens = min_tokens  # as in SGLang, no stop string ends a request before this many ids
        self.num_generated = 0
        self.detokenizer = tokenizer.detokenizer(prompt_ids, skip_special_tokens=skip_special_tokens)
        self.keep = max((len(s) for s in self.stop_strings), default=1) - 1
        self.tail = ""

    def push(self, ids: Sequence[int]) -> tuple[list[int], str | None]:
        """Returns the ids to keep (all of them, or those up to the one completing a stop string)
        and the stop string that matched, if any."""
        for position, token_id in enumerate(ids):
            self.num_generated += 1
            delta = self.detokenizer.push([token_id])
            if not delta:
                continue
            text = self.tail + delta
            matches = [(text.find(s), s) for s in self.stop_strings if s in text]
            if matches and self.num_generated >= self.min_tokens:
                return list(ids[: position + 1]), min(matches)[1]
            self.tail = text[-self.keep:] if self.keep else ""
        return list(ids), None
