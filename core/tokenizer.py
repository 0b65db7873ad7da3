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
from tokenizers.decoders import DecodeStream

from openinfer.errors import InvalidRequestError
from openinfer.plugins import discover_plugins
from openinfer.tiktoken_tokenizer import load_tiktoken_dir

# Prompt tokens the detokenizer decodes as context, so word-boundary rules (leading spaces of
# SentencePiece pieces, merged byte sequences) come out the same as decoding the whole text.
DETOKENIZER_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"
# How many input characters a normalizer may fold into one (NFKC composes up to 3 Hangul jamo);
# used only to bound text length before tokenizing.
NORMALIZER_SLACK = 4
# texts at least this long are encoded with the GIL released (a few ms of encoding and up)
GIL_RELEASING_ENCODE_CHARS = 16_384
GIL_RELEASING_DECODE_IDS = 4_096


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's printable character → byte table, the inverse of the alphabet byte-level BPE
    vocabularies are written in (printable Latin-1 bytes stand for themselves, the rest are
    shifted to U+0100 onwards in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + shifted)] = byte
            shifted += 1
    return table


BYTE_LEVEL_DECODER = _byte_level_decoder()


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
                 default_max_new_tokens: int | None = None, chat_encoder: ChatEncoder | None = None):
        # a tokenizer.json may carry truncation or padding settings (e.g. max_length 512): a prompt is
        # never cut or padded silently (transformers turns both off unless a call asks for them)
        if raw.truncation is not None:
            raw.no_truncation()
        if raw.padding is not None:
            raw.no_padding()
        self.raw = raw
        # generation_config.json's max_new_tokens: the model's own default output length
        self.default_max_new_tokens = default_max_new_tokens
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
        """Load from a Hugging Face style model directory (tokenizer.json, or a tiktoken.model)."""
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        config = _read_json(directory / "tokenizer_config.json")
        if tokenizer_file.is_file():
            raw = RawTokenizer.from_file(str(tokenizer_file))
        elif (directory / "tiktoken.model").is_file():  # Kimi-K2 / Moonlight
            raw = load_tiktoken_dir(directory, config)
        else:
            raise TokenizerNotFoundError(
                f"no tokenizer.json (or tiktoken.model) in {str(directory)!r}; pass a model directory with a "
                "Hugging Face fast tokenizer (or --tokenizer DIR)", "tokenizer")
        template: str | list[dict[str, str]] | None = config.get("chat_template")
        template_file = directory / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text(encoding="utf-8")
        generation = _read_json(directory / "generation_config.json")
        eos = generation.get("eos_token_id")
        eos_ids = None if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        max_new = generation.get("max_new_tokens")
        max_new = max_new if isinstance(max_new, int) and not isinstance(max_new, bool) and max_new > 0 else None
        encoder = None if template else _plugin_chat_encoder(directory)
        return cls(raw, config, template, eos_ids, str(directory), max_new, encoder)

    # --- ids <-> text ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.raw.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self.raw.token_to_id(self.bos_token) if self.bos_token else None

    @cached_property
    def max_chars_per_token(self) -> int:
        """The most characters of text one token can stand for: the longest vocabulary entry (a
        byte-level piece has one character per byte, at least as many as the text it decodes to)."""
        return max(map(len, self.raw.get_vocab(with_added_tokens=True)), default=1) or 1

    @cached_property
    def _normalizer_slack(self) -> int:
        """A normalizer (NFKC, ...) may fold several input characters into one."""
        return NORMALIZER_SLACK if json.loads(self.raw.to_str()).get("normalizer") else 1

    def check_length(self, text: str, max_tokens: int, field: str = "prompt") -> None:
        """Refuse, without tokenizing it, text that cannot fit in ``max_tokens`` tokens: text longer
        than ``max_tokens * max_chars_per_token`` characters (times the normalizer's slack) cannot.
        This bounds the CPU time one request can spend in the tokenizer."""
        limit = max_tokens * self.max_chars_per_token * self._normalizer_slack
        if len(text) > limit:
            raise InvalidRequestError(
                f"{field} has {len(text)} characters, more than {max_tokens} tokens can hold (this vocabulary's "
                f"tokens are at most {self.max_chars_per_token} characters long); shorten it", field)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. A long text goes through ``encode_batch``: the tokenizers library's
        ``encode`` holds the GIL while it works (seconds for a long prompt, during which every other
        thread of the process, an API server's event loop included, stands still), ``encode_batch``
        releases it. Short texts keep ``encode``, which is cheaper to call."""
        try:
            if len(text) < GIL_RELEASING_ENCODE_CHARS:
                return self.raw.encode(text, add_special_tokens=add_special_tokens).ids
            return self.raw.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except TypeError as exc:  # the Rust side takes valid Unicode only (no lone surrogates)
            raise InvalidRequestError(f"the text cannot be tokenized: {exc} (is it valid UTF-8 text, without "
                                      "lone surrogates such as \\ud800?)", "prompt") from exc

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``; a long list through ``decode_batch``, which releases the GIL (as for
        ``encode``: ``decode`` holds it, about a second per million ids)."""
        if len(ids) < GIL_RELEASING_DECODE_IDS:
            return self.raw.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.raw.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (what OpenAI's logprob ``bytes`` carry): byte-level BPE
        pieces are mapped back from GPT-2's printable byte alphabet, SentencePiece byte-fallback
        pieces ``<0xNN>`` are that byte and ``▁`` is a space; special tokens are their text."""
        piece = self.raw.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added_token_ids:
            return piece.encode("utf-8")
        if self._is_byte_level and all(c in BYTE_LEVEL_DECODER for c in piece):
            return bytes(BYTE_LEVEL_DECODER[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode("utf-8")

    def token_text(self, token_id: int) -> str:
        """The text of one token for logprob tables: its bytes as UTF-8; a token holding only part
        of a character shows its bytes escaped (``\\xf0\\x9f``), the ``bytes`` field has them exact."""
        return self.token_bytes(token_id).decode("utf-8", errors="backslashreplace")

    @cached_property
    def _added_token_ids(self) -> frozenset[int]:
        return frozenset(self.raw.get_added_tokens_decoder())

    @cached_property
    def _is_byte_level(self) -> bool:
        """Whether the vocabulary is spelled in GPT-2's byte alphabet (a ByteLevel decoder)."""
        decoder = json.loads(self.raw.to_str()).get("decoder") or {}
        parts = decoder.get("decoders") or [decoder]
        return any(isinstance(part, Mapping) and part.get("type") == "ByteLevel" for part in parts)

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
        # tokenizers' streaming decoder: one Rust call per token, no re-decoding of a window
        self._stream = DecodeStream(ids=list(self.ids), skip_special_tokens=skip_special_tokens)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, new_ids: Iterable[int]) -> str:
        raw, step = self.tokenizer.raw, self._stream.step
        text = ""
        for token_id in new_ids:
            self.ids.append(token_id)
            chunk = step(raw, token_id)
            if chunk:
                text += chunk
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
        return text

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
