"""OpenAI wire format as pydantic models: requests (validated, unknown fields ignored) and responses.

Request models reject what OpenAI rejects (types, ranges); a failed validation becomes a 400 in
OpenAI's error shape (see ``errors.py``). Fields OpenAI has and openinfer cannot honour are
refused with a message rather than silently ignored.
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)

from openinfer.sampling import MAX_LOGPROBS

MAX_N = 128
INT32_LIMIT = 2**31  # counts and ids travel as (u)int32 in the engine contract
TokenId = Annotated[int, Field(ge=0, lt=INT32_LIMIT, strict=True)]
# OpenAI's own limits (an extension beyond them would be deliberate and documented)
MAX_TEMPERATURE = 2.0
MAX_COMPLETION_LOGPROBS = 5
MAX_STOP_STRINGS = 4
# Names the server itself passes to chat templates: chat_template_kwargs may not override them.
RESERVED_TEMPLATE_ARGS = frozenset({"messages", "add_generation_prompt", "tools", "bos_token", "eos_token",
                                    "unk_token", "pad_token", "raise_exception", "strftime_now"})
_SURROGATE = re.compile("[\ud800-\udfff]")


class RefusedField(ValueError):
    """A request field the server refuses; ``field`` becomes the error's ``param``."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


_SCALAR_TYPES = frozenset({int, float, bool, type(None)})
# what a TokenId is, for msgspec: an int (never a bool or a float) in [0, INT32_LIMIT)
_TOKEN_ID_LIST = list[Annotated[int, msgspec.Meta(ge=0, lt=INT32_LIMIT)]]


class TokenIds(list):
    """A prompt of token ids whose every element was already checked to be a ``TokenId``, in one
    C pass (``checked_token_ids``): the prompt field takes it as it is (``_pass_checked_ids``)
    instead of validating 16k ints one by one in pydantic (~1-3 ms of a warm 16k request)."""


class TokenIdArray:
    """A prompt of token ids parsed from the request body straight into one read-only int32 array
    (``token_id_array``), every id already checked to be a ``TokenId``: it goes to the engine as
    that one buffer, never as a Python list of ints (a 16k-id prompt: ~1 ms less per request)."""

    __slots__ = ("ids",)

    def __init__(self, ids: np.ndarray):
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenIdArray):
            return np.array_equal(self.ids, other.ids)
        return isinstance(other, list) and self.ids.tolist() == other

    __hash__ = None  # mutable-looking, compared by value

    def __repr__(self) -> str:
        return f"TokenIdArray({len(self.ids)} ids)"


def _pass_checked_ids(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """Checked ids as they are; anything else through the field's own validation (its errors and
    JSON schema unchanged)."""
    return value if isinstance(value, TokenIds | TokenIdArray) else handler(value)


_JSON_WHITESPACE = b" \t\n\r"
_ID_LIST_BYTES = b"0123456789," + _JSON_WHITESPACE  # all a flat list of non-negative ints holds
_COMMA = ord(",")


def _fromstring_is_strict() -> bool:
    """Whether ``np.fromstring`` raises on text it cannot read to its end (NumPy 2: a fraction,
    exponent, string, bool, null or nested list among the ids) instead of warning and returning
    the ids before it (NumPy 1.x)."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            np.fromstring(b"1,2.5", dtype=np.int64, sep=",")
    except ValueError:
        return True
    return False


# NumPy raises on anything but integers: only signs are left to find (``token_id_array``)
_STRICT_FROMSTRING = _fromstring_is_strict()


def token_id_array(raw: bytes) -> np.ndarray | None:
    """The ids of ``raw``, the JSON text of a non-empty flat list of ``TokenId``s (as msgspec
    validated it: a ``msgspec.Raw`` of a decoded body), as a read-only int32 array, or None for
    anything else (pydantic then validates the decoded value with its own messages). One C pass
    to check that it holds only digits, commas and whitespace (so no sign, fraction, exponent,
    bool or null: valid JSON made of those is non-negative integers), one to parse it. Where
    NumPy's parser raises on any non-integer (``_STRICT_FROMSTRING``), the check is only for
    signs (two ``memchr`` scans instead of a translation of every byte: ~0.06 ms of a 16k-id body)."""
    raw = bytes(raw).strip(_JSON_WHITESPACE)
    if raw[:1] != b"[" or raw[-1:] != b"]":
        return None
    inner = raw[1:-1]
    if not inner.strip(_JSON_WHITESPACE):
        return None
    if (b"-" in inner or b"+" in inner) if _STRICT_FROMSTRING else inner.translate(None, _ID_LIST_BYTES):
        return None
    try:
        ids = np.fromstring(inner, dtype=np.int64, sep=",")  # text mode: C strtol per id
    except ValueError:
        return None
    # an id too large for int64 saturates (caught by the limit), so the count and range decide
    # (commas counted by NumPy: ``bytes.count`` took ~0.07 ms of a 16k-id body, this ~0.02)
    num_commas = int(np.count_nonzero(np.frombuffer(inner, np.uint8) == _COMMA))
    if len(ids) != num_commas + 1 or not 0 <= ids.min() or ids.max() >= INT32_LIMIT:
        return None
    ids = ids.astype(np.int32)
    ids.flags.writeable = False
    return ids


def checked_token_ids(value: Any) -> TokenIds | None:
    """``value`` as ``TokenIds`` when it is a non-empty list of ``TokenId``s, else None (pydantic
    then validates it as before, with its own messages for what is wrong)."""
    if type(value) is not list or not value or type(value[0]) is not int:
        return None
    try:
        msgspec.convert(value, _TOKEN_ID_LIST)
    except Exception:  # noqa: BLE001 - not all TokenIds (a lone surrogate's str even fails the message): pydantic says why
        return None
    return TokenIds(value)


def _find_lone_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string (key or value) holding a lone UTF-16 surrogate, if any.
    JSON allows ``"\\ud800"`` escapes, but such text has no UTF-8 form: no tokenizer can read it."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and _SURROGATE.search(key):
                return where
            found = _find_lone_surrogate(item, where)
            if found:
                return found
    elif isinstance(value, TokenIds):  # ints only, checked
        return None
    elif isinstance(value, list):
        # a prompt of token ids is a list of 16k ints: one C-level pass over the element types
        # answers "no text in here" (walking it item by item cost ~1 us per token id)
        if not set(map(type, value)) - _SCALAR_TYPES:
            return None
        for index, item in enumerate(value):
            if isinstance(item, str | dict | list):
                found = _find_lone_surrogate(item, f"{path}.{index}" if path else str(index))
                if found:
                    return found
    return None


class Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TopLevelRequest(Request):
    """A whole request body: text anywhere in it must be valid Unicode (no lone surrogates)."""

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        where = _find_lone_surrogate(data, "")
        if where:
            raise RefusedField(where, f"{where} contains a lone UTF-16 surrogate (e.g. \\ud800), which is "
                                      "not valid Unicode text; send well-formed UTF-8")
        return data


class StreamOptions(Request):
    include_usage: bool = False
    # vLLM's extension: every streamed chunk carries the usage so far (clients count tokens per chunk)
    continuous_usage_stats: bool = False


class SamplingFields(TopLevelRequest):
    """Fields /v1/completions and /v1/chat/completions share."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, lt=INT32_LIMIT)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, lt=INT32_LIMIT)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # requests with different salts never share prefix-cache blocks (tenant isolation)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    skip_special_tokens: bool = True
    # OpenAI: token id (as a string) -> bias in [-100, 100] added to that token's logit
    logit_bias: dict[str, float] | None = None
    # structured outputs: OpenAI's response_format (text, json_object, json_schema) or vLLM's
    # structured_outputs (exactly one of json, regex, choice, grammar, json_object)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> SamplingFields:
        for key, value in (self.logit_bias or {}).items():
            if not key.strip().isdigit() or int(key) >= INT32_LIMIT:
                raise RefusedField("logit_bias", f"logit_bias keys are token ids (non-negative integers as "
                                                 f"strings), got {key!r}")
            if not -100 <= value <= 100:
                raise RefusedField("logit_bias", f"logit_bias values must be in [-100, 100], got {value} for "
                                                 f"token {key}")
        if self.stream_options is not None and not self.stream:
            raise RefusedField("stream_options", "stream_options is only allowed when stream is true")
        return self

    def token_bias(self) -> dict[int, float]:
        return {int(key): value for key, value in (self.logit_bias or {}).items()}

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingFields):
    # left to right, token ids before strings: a 16k-id prompt tried as list[str] first (pydantic's
    # smart union) built 16k errors before matching, ~10 ms per request
    # (a list of token ids checked by _token_id_prompt is taken as it is)
    prompt: Annotated[str | list[TokenId] | list[list[TokenId]] | list[str],
                      WrapValidator(_pass_checked_ids)] = Field(union_mode="left_to_right")
    max_tokens: int | None = Field(16, ge=1, lt=INT32_LIMIT)
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _token_id_prompt(cls, data: Any) -> Any:
        """A prompt of token ids checked in one C pass (runs before the lone-surrogate walk, which
        then skips it)."""
        if isinstance(data, dict) and (ids := checked_token_ids(data.get("prompt"))) is not None:
            data = {**data, "prompt": ids}
        return data

    @model_validator(mode="after")
    def _completion_rules(self) -> CompletionRequest:
        if self.suffix:
            raise RefusedField("suffix", "suffix is not supported by this server; leave it out")
        if self.best_of is not None and self.best_of != self.n:
            raise RefusedField("best_of", "best_of must equal n (this server does not rank extra candidates)")
        return self


class ChatMessage(Request):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, lt=INT32_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, lt=INT32_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    # vLLM extension: top-N logprobs of every prompt token (the first has none)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _chat_rules(self) -> ChatCompletionRequest:
        # the deprecated functions API: tools/tool_choice say the same and are served
        if self.functions:
            raise RefusedField("functions", "functions (deprecated by OpenAI) is not supported; send the same "
                                            "definitions as tools=[{'type': 'function', 'function': ...}]")
        if self.function_call not in (None, "none"):
            raise RefusedField("function_call", "function_call (deprecated by OpenAI) is not supported; use "
                                                "tool_choice")
        reserved = sorted(RESERVED_TEMPLATE_ARGS & set(self.chat_template_kwargs or {}))
        if reserved:
            raise RefusedField("chat_template_kwargs",
                               f"chat_template_kwargs may not set {', '.join(reserved)}: the server passes "
                               "these to the template itself (use the request's own fields)")
        if self.top_logprobs and not self.logprobs:
            raise RefusedField("top_logprobs", "top_logprobs needs logprobs set to true")
        if self.stream and self.prompt_logprobs is not None:
            raise RefusedField("prompt_logprobs", "prompt_logprobs are returned with stream=false only "
                                                  "(as in vLLM); drop one of them")
        return self

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(TopLevelRequest):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise RefusedField("prompt", "give exactly one of prompt or messages")
        return self


class DetokenizeRequest(TopLevelRequest):
    model: str | None = None
    tokens: list[TokenId]


# --- responses -------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int) -> Usage:
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   prompt_tokens_details={"cached_tokens": cached})


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprobEntry(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprobEntry(TopLogprobEntry):
    top_logprobs: list[TopLogprobEntry] = []


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobEntry] = []


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatDeltaChoice(BaseModel):
    index: int
    delta: dict[str, Any]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    # vLLM's shape: per prompt token, None (the first) or {token id: {logprob, rank, decoded_token}}
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatDeltaChoice]
    usage: Usage | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body, sent with every 4xx and 5xx."""

    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "openinfer"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class HealthStatus(BaseModel):
    status: Literal["ok"] = "ok"


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str
