"""The text side shared by the frontends: tokenizer, chat template, incremental detokenizer, stop strings.

Engines see token ids only. Everything that turns text into ids and back lives here:

* ``Tokenizer.from_dir`` loads ``tokenizer.json`` (the ``tokenizers`` library),
  ``tokenizer_config.json`` (special tokens, ``chat_template``; or a ``chat_template.jinja``
  file beside it) and ``generation_config.json`` (eos ids).
* ``Tokenizer.apply_chat_template`` renders messages with Jinja2 the way Hugging Face does
  (sandboxed, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``strftime_now``, ``tojson``);
  a model without a Jinja template (DeepSeek-V4) gets its plugin's ``ChatEncoder`` instead,
  found through the ``openinfer_chat_encoder`` hook from the directory's ``config.json``.
* ``IncrementalDetokenizer`` turns a growing id list into text deltas and never emits a
  partial UTF-8 character (text ending in U+FFFD is held back until the next token completes it).
* ``StopStringMatcher`` withholds text that may still become a stop string.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as RawTokenizer

from openinfer.errors import InvalidRequestError
from openinfer.plugins import discover_plugins

# Prompt tokens the detokenizer decodes as context, so word-boundary rules (leading spaces of
# SentencePiece pieces, merged byte sequences) come out the same as decoding the whole text.
DETOKENIZER_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class ChatEncoder(Protocol):
    """Turns chat messages into the prompt text for models that ship no Jinja chat template."""

    def encode(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **options: Any) -> str: ...


class TokenizerNotFoundError(InvalidRequestError):
    """The model directory has no tokenizer.json."""


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as a string or as {"content": ...}."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        return json.load(f)


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template and end-of-sequence ids."""

    def __init__(self, raw: RawTokenizer, config: Mapping[str, Any] | None = None,
                 chat_template: str | list[dict[str, str]] | None = None,
                 eos_token_ids: Sequence[int] | None = None, path: str = "",
                 chat_encoder: ChatEncoder | None = None):
        self.raw = raw
        self.chat_encoder = chat_encoder
        self.config = dict(config or {})
        self.path = path
        self.bos_token = _token_content(self.config.get("bos_token"))
        self.eos_token = _token_content(self.config.get("eos_token"))
        self.chat_template = chat_template if chat_template is not None else self.config.get("chat_template")
        if eos_token_ids is None:
            eos_id = raw.token_to_id(self.eos_token) if self.eos_token else None
            eos_token_ids = [] if eos_id is None else [eos_id]
        self.eos_token_ids = list(eos_token_ids)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load from a Hugging Face style model directory (needs tokenizer.json)."""
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerNotFoundError(
                f"no tokenizer.json in {str(directory)!r}; pass a model directory with a Hugging Face "
                "fast tokenizer (or --tokenizer DIR)", "tokenizer")
        raw = RawTokenizer.from_file(str(tokenizer_file))
        config = _read_json(directory / "tokenizer_config.json")
        template: str | list[dict[str, str]] | None = config.get("chat_template")
        template_file = directory / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text(encoding="utf-8")
        generation = _read_json(directory / "generation_config.json")
        eos = generation.get("eos_token_id")
        eos_ids = None if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        encoder = None if template else _plugin_chat_encoder(directory)
        return cls(raw, config, template, eos_ids, str(directory), encoder)

    # --- ids <-> text ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.raw.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self.raw.token_to_id(self.bos_token) if self.bos_token else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.raw.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.raw.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token for logprob tables; falls back to the raw vocab entry when the
        token alone is not valid UTF-8 (a byte-level piece of a longer character)."""
        text = self.raw.decode([token_id], skip_special_tokens=False)
        if REPLACEMENT_CHAR in text or not text:
            return self.raw.id_to_token(token_id) or text
        return text

    def detokenizer(self, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)

    # --- chat template --------------------------------------------------------------------------

    def _select_template(self, has_tools: bool) -> str:
        template = self.chat_template
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {entry.get("name"): entry.get("template") for entry in template}
            template = (named.get("tool_use") if has_tools else None) or named.get("default")
        if not template:
            raise InvalidRequestError(
                "this model has no chat template (tokenizer_config.json has no chat_template); "
                "use /v1/completions with a raw prompt, or serve a model directory that has one",
                "messages")
        return template

    @cached_property
    def _jinja(self) -> jinja2.Environment:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols, GenerationTag])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            **template_kwargs: Any) -> str:
        """Render ``messages`` (OpenAI dicts; list content flattened to text) to the prompt string."""
        if not self.chat_template and self.chat_encoder is not None:
            return self.chat_encoder.encode([normalize_message(m) for m in messages],
                                            add_generation_prompt=add_generation_prompt, tools=tools,
                                            **template_kwargs)
        source = self._select_template(bool(tools))
        try:
            template = self._jinja.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise InvalidRequestError(f"the model's chat template does not compile: {exc}", "messages") from exc
        special = {name: _token_content(self.config.get(name)) or ""
                   for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
        variables = {**special, **template_kwargs, "messages": [normalize_message(m) for m in messages],
                     "add_generation_prompt": add_generation_prompt, "tools": tools}
        try:
            return template.render(**variables)
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"the chat template rejected the messages: {exc}", "messages") from exc
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise InvalidRequestError(f"the chat template could not render these messages: {exc!r}",
                                      "messages") from exc


def _plugin_chat_encoder(directory: Path) -> ChatEncoder | None:
    """The chat encoder the model's plugin brings, from ``config.json`` beside the tokenizer."""
    config_file = directory / "config.json"
    if not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return discover_plugins().chat_encoder(config) if isinstance(config, dict) else None


class GenerationTag(jinja2.ext.Extension):
    """HF's ``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks):
    rendering only needs the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class ChatTemplateError(jinja2.TemplateError):
    """Raised by ``raise_exception(...)`` inside a chat template."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """HF's ``tojson``: no HTML escaping, non-ASCII kept (unlike Jinja's built-in filter)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def normalize_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI message as chat templates expect it: ``content`` given as a list of text parts
    becomes one string (parts joined by newlines); non-text parts are refused."""
    result = {k: v for k, v in message.items() if v is not None or k == "content"}
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind not in ("text", "input_text"):
                raise InvalidRequestError(
                    f"content part of type {kind!r} is not supported; this server accepts text parts only",
                    "messages")
            texts.append(str(part.get("text", "")))
        result["content"] = "\n".join(texts)
    return result


class IncrementalDetokenizer:
    """Token ids in, text deltas out.

    Invariant: the concatenation of every ``push`` result and the final ``flush`` equals the text
    of the generated ids decoded in the context of the prompt tail, and no delta ever ends inside
    a multi-byte character. Offsets follow vLLM: ``ids[prefix_offset:read_offset]`` is the already
    emitted context window; ``ids[read_offset:]`` the ids whose text is still pending.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-DETOKENIZER_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, new_ids: Iterable[int]) -> str:
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new yet, or a character is still incomplete: hold it back
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes as U+FFFD)."""
        if self.read_offset >= len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return new_text[len(prefix_text):]


class StopStringMatcher:
    """Cuts generated text at the first stop string.

    Invariant: text returned by ``push`` never contains a stop string nor the start of one that
    may still complete: any suffix of the pending text that is a prefix of a stop string is
    withheld until the next push proves it is not (or ``flush`` at the end releases it).
    """

    def __init__(self, stop_strings: Sequence[str]):
        self.stop_strings = [s for s in stop_strings if s]
        self.pending = ""
        self.stopped = False

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was found)."""
        if not self.stop_strings:
            return text, False
        self.pending += text
        positions = [i for i in (self.pending.find(s) for s in self.stop_strings) if i >= 0]
        if positions:
            emitted, self.pending, self.stopped = self.pending[:min(positions)], "", True
            return emitted, True
        hold = 0
        for stop in self.stop_strings:
            for size in range(min(len(stop) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(stop[:size]):
                    hold = size
                    break
        cut = len(self.pending) - hold
        emitted, self.pending = self.pending[:cut], self.pending[cut:]
        return emitted, False

    def flush(self) -> str:
        emitted, self.pending = self.pending, ""
        return emitted
