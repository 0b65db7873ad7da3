"""Structured outputs: a constraint (JSON Schema, any JSON object, regex, choice, grammar) becomes
a per-request grammar matcher that masks, at every step, each token that cannot continue a
valid output.

The grammar engine is llguidance (chosen over xgrammar by measured mask time and coverage; see
``benchmarks/grammar_mask.py`` and its JSON). Who does what:

* frontends call :func:`check_constraint` so an invalid schema / regex / grammar is a 400 (or
  INVALID_ARGUMENT) naming the problem before anything reaches the engine;
* the engine owns one :class:`GrammarCompiler` per tokenizer (the vocabulary as llguidance sees
  it is built once from ``tokenizer.json``) and gives each constrained request a
  :class:`GrammarMatcher`;
* after a token is chosen the matcher consumes it (``SamplingState.record``) and its next mask
  is computed at once on a background thread (:class:`NextMasks`), during the engine's
  read-back, scheduling and next forward;
* each step, :meth:`GrammarCompiler.fill_bitmasks` collects the allowed-token bitmask of every
  constrained row (one int32 word per 32 tokens, bit ``t % 32`` of word ``t // 32`` set = token
  ``t`` allowed; computed there for rows without a background mask, e.g. a new request); the
  samplers apply it (:func:`apply_bitmask` per row on NumPy, one kernel for the whole batch on
  CUDA, rows with and without a grammar together).

JSON is generated compactly with Python's separators (``", "`` and ``": "``) and no other
whitespace, so a sampled output can neither stall in whitespace nor differ between paths.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path

import llguidance as llg
import llguidance.numpy as llg_numpy
import numpy as np

from openinfer.errors import InvalidRequestError
from openinfer.v1 import engine_pb2 as pb

logger = logging.getLogger("openinfer.structured")
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FIELD = "structured_output"


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def _refuse(kind: str, problem: str) -> InvalidRequestError:
    return InvalidRequestError(f"invalid {kind} constraint: {problem}", FIELD)


def _json_schema_grammar(schema_text: str) -> str:
    try:
        schema = json.loads(schema_text)
    except json.JSONDecodeError as exc:
        raise _refuse("json_schema", f"the schema is not valid JSON ({exc})") from exc
    if not isinstance(schema, (dict, bool)):
        raise _refuse("json_schema", f"a JSON Schema is an object (or true/false), got {type(schema).__name__}")
    return llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)


def grammar_of(constraint: pb.StructuredOutput) -> str:
    """The llguidance grammar for ``constraint``; raises ``InvalidRequestError`` for an empty or
    malformed one (without compiling it: see :func:`check_constraint`)."""
    kind = constraint.WhichOneof("kind")
    if kind == "json_schema":
        return _json_schema_grammar(constraint.json_schema)
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if kind == "regex":
        if not constraint.regex:
            raise _refuse("regex", "the pattern is empty")
        return llg.LLMatcher.grammar_from_regex(constraint.regex)
    if kind == "choice":
        choices = list(constraint.choice.choices)
        if not choices:
            raise _refuse("choice", "give at least one choice")
        return llg.grammar_from("choice", json.dumps(choices))
    if kind == "grammar":
        if not constraint.grammar.strip():
            raise _refuse("grammar", "the grammar is empty")
        try:
            return llg.grammar_from("grammar", constraint.grammar)
        except ValueError as exc:
            raise _refuse("grammar", str(exc)) from exc
    raise _refuse("structured output", "no kind is set (json_schema, json_object, regex, choice or grammar)")


def after_thought(constraint: pb.StructuredOutput, think_end_id: int) -> pb.StructuredOutput | None:
    """``constraint`` for a generation that starts inside a thought (the prompt ended with
    ``<think>``): any tokens but ``think_end_id``, that token, then the value. Only for constraints
    on one value (JSON Schema, JSON object, choice); None for the others (a regex or grammar
    describes the whole output, thought included, itself)."""
    kind = constraint.WhichOneof("kind")
    if kind in ("json_schema", "json_object"):
        schema = json.loads(constraint.json_schema) if kind == "json_schema" else {"type": "object"}
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            return None
        value = "%json" + json.dumps({**schema, "x-guidance": JSON_OPTIONS})
    elif kind == "choice":
        value = " | ".join(json.dumps(choice) for choice in constraint.choice.choices)
    else:
        return None
    return pb.StructuredOutput(grammar=f"start: <[^{think_end_id}]>* <[{think_end_id}]> value\nvalue: {value}")


def check_constraint(constraint: pb.StructuredOutput) -> None:
    """Compile-check ``constraint`` without a tokenizer; the error names what is wrong."""
    grammar = grammar_of(constraint)
    problem = llg.LLMatcher.validate_grammar(grammar)
    if problem:
        raise _refuse(constraint.WhichOneof("kind"), problem.strip())


class GrammarMatcher:
    """One request's position in its grammar. ``accept`` advances it by a sampled token and, with
    ``next_masks``, starts computing the next step's mask at once on a background thread (the
    mask depends only on the tokens consumed), so it is ready when the next step samples."""

    def __init__(self, matcher: llg.LLMatcher, next_masks: NextMasks | None = None):
        self._matcher = matcher
        self._next_masks = next_masks
        self._mask: np.ndarray | None = None  # the allowed tokens in the current state, once computed
        self._mask_ready: threading.Event | None = None  # set when a background computation ends

    @property
    def matcher(self) -> llg.LLMatcher:
        return self._matcher

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; False when the grammar forbids it (the matcher is then in an
        error state: only a bug or an unconstrained token such as a forced stop gets here)."""
        self._wait_for_mask()  # the background thread may still be reading this state
        self._mask = None
        if self._matcher.is_stopped():
            return True  # the grammar is complete: the only tokens left are the stop tokens
        accepted = self._matcher.consume_token(token_id)
        if self._next_masks is not None:
            self._mask_ready = threading.Event()
            if not self._next_masks.schedule(self):
                self._mask_ready = None
        return accepted

    def is_terminated(self) -> bool:
        self._wait_for_mask()
        return self._matcher.is_stopped()

    def computed_mask(self) -> np.ndarray | None:
        """The current state's mask, waiting for a background computation under way; None when
        none was made (a new matcher, or no background thread)."""
        self._wait_for_mask()
        return self._mask

    def fill(self, bitmask_row: np.ndarray) -> None:
        mask = self.computed_mask()
        if mask is not None:
            bitmask_row[:] = mask
        else:
            llg_numpy.fill_next_token_bitmask(self._matcher, bitmask_row.reshape(1, -1), 0)

    def _wait_for_mask(self) -> None:
        if self._mask_ready is not None:
            self._mask_ready.wait()
            self._mask_ready = None

    def _set_mask(self, mask: np.ndarray | None) -> None:
        """Called by the background thread."""
        self._mask = mask
        assert self._mask_ready is not None
        self._mask_ready.set()


class NextMasks:
    """The background thread that computes the masks of matchers that have just consumed a token.

    The engine thread records a step's tokens one row after another; the thread takes every
    matcher scheduled so far as one batch, fills their masks in parallel on llguidance's
    executor (one call, the GIL released throughout) and repeats until nothing is left, then
    waits for the next step a while before it exits. So the mask work of step N+1 runs during
    the engine's read-back, scheduling and forward of step N+1 instead of after them.

    At interpreter exit every instance is closed (:func:`atexit`) before the runtime is torn
    down: a daemon thread still inside llguidance then would write into freed memory."""

    IDLE_EXIT_S = 2.0

    def __init__(self, executor: llg.LLExecutor, vocab_size: int):
        self._executor = executor
        self._words = bitmask_words(vocab_size)
        self._wakeup = threading.Condition()
        self._pending: list[GrammarMatcher] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        _OPEN_NEXT_MASKS.add(self)

    def schedule(self, matcher: GrammarMatcher) -> bool:
        """Compute ``matcher``'s mask in the background; False when closed (it is then computed
        when asked)."""
        with self._wakeup:
            if self._closed:
                return False
            self._pending.append(matcher)
            if self._thread is not None:
                self._wakeup.notify()
                return True
            self._thread = threading.Thread(target=self._run, name="openinfer-grammar-masks", daemon=True)
            self._thread.start()
            return True

    def close(self) -> None:
        """Finish the masks under way and stop the thread."""
        with self._wakeup:
            self._closed = True
            thread = self._thread
            self._wakeup.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        while True:
            with self._wakeup:
                if not self._pending and not self._closed:
                    self._wakeup.wait(self.IDLE_EXIT_S)
                if not self._pending:
                    self._thread = None
                    return
                batch, self._pending = self._pending, []
            bitmask = np.empty((len(batch), self._words), dtype=np.int32)
            try:
                llg_numpy.fill_next_token_bitmask_par(self._executor, [(m.matcher, i) for i, m in enumerate(batch)],
                                                      bitmask)
            except Exception:  # the engine thread then computes these masks itself (and sees the error)
                logger.exception("computing grammar masks in the background failed")
                bitmask = None
            for row, matcher in enumerate(batch):
                matcher._set_mask(bitmask[row] if bitmask is not None else None)


_OPEN_NEXT_MASKS: weakref.WeakSet[NextMasks] = weakref.WeakSet()


@atexit.register
def _close_next_masks() -> None:
    for next_masks in list(_OPEN_NEXT_MASKS):
        next_masks.close()


def _printable_ascii(text: str) -> bool:
    return bool(text) and all("!" <= ch <= "~" for ch in text)


def grammar_tokenizer_json(tokenizer_json: str) -> str:
    """``tokenizer.json`` as llguidance should see it. llguidance treats every *added* token as a
    special token, so a non-special added token that the model writes as text (Qwen3's
    ``<tool_call>``, ``<think>``) would be allowed by a mask for its text and then refused when
    consumed. In byte-level BPE vocabularies such a token (printable ASCII, which the byte
    alphabet maps to itself) is moved into the regular vocabulary under its id."""
    data = json.loads(tokenizer_json)
    model = data.get("model") or {}
    vocab = model.get("vocab")
    byte_level = "ByteLevel" in json.dumps(data.get("decoder"))
    if not (byte_level and isinstance(vocab, dict)):
        return tokenizer_json
    kept = []
    for token in data.get("added_tokens") or []:
        content = token.get("content", "")
        if not token.get("special", True) and _printable_ascii(content) and content not in vocab:
            vocab[content] = token["id"]
        else:
            kept.append(token)
    data["added_tokens"] = kept
    return json.dumps(data, ensure_ascii=False)


class GrammarCompiler:
    """Builds matchers for one vocabulary. ``vocab_size`` is the model's (logit rows may be wider
    than the tokenizer: padding ids are never allowed)."""

    def __init__(self, tokenizer: str | llg.LLTokenizer, vocab_size: int, eos_token_ids: Sequence[int] = (),
                 background_masks: bool = True):
        """``tokenizer``: the text of a ``tokenizer.json``, or an llguidance tokenizer;
        ``background_masks``: matchers compute their next mask on a background thread as soon
        as they consume a token (see :class:`NextMasks`); off, every mask is computed when asked."""
        self.vocab_size = vocab_size
        if isinstance(tokenizer, str):
            tokenizer = llg.LLTokenizer(grammar_tokenizer_json(tokenizer), n_vocab=vocab_size,
                                        eos_token=list(eos_token_ids) or None)
        self.tokenizer = tokenizer
        # a batch's masks are filled in parallel; half the cores, as the forward needs the others on the CPU
        self._executor = llg.LLExecutor(num_threads=max(2, min(8, (os.cpu_count() or 2) // 2)))
        self._next_masks = NextMasks(self._executor, vocab_size) if background_masks else None

    @classmethod
    def from_dir(cls, tokenizer_dir: str, vocab_size: int, eos_token_ids: Sequence[int],
                 background_masks: bool = True) -> GrammarCompiler:
        """From ``tokenizer.json``, or a tiktoken vocabulary (``tiktoken.model``: Kimi-K2)."""
        directory = Path(tokenizer_dir)
        if (directory / "tokenizer.json").is_file():
            return cls((directory / "tokenizer.json").read_text(encoding="utf-8"), vocab_size, eos_token_ids,
                       background_masks)
        if (directory / "tiktoken.model").is_file():
            from openinfer.tiktoken_tokenizer import tiktoken_encoding

            config_path = directory / "tokenizer_config.json"
            config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
            encoding = tiktoken_encoding(directory, config)
            return cls(llg.LLTokenizer.from_tiktoken(
                encoder=encoding._mergeable_ranks, special_tokens=encoding._special_tokens,
                pattern=encoding._pat_str, eos_token=list(eos_token_ids) or encoding.eot_token,
                n_vocab=vocab_size), vocab_size, background_masks=background_masks)
        raise InvalidRequestError(
            f"structured outputs need the model's tokenizer (tokenizer.json or tiktoken.model), which is not in "
            f"{tokenizer_dir!r}; serve a model directory with a tokenizer (or pass --tokenizer)", FIELD)

    def compile(self, constraint: pb.StructuredOutput) -> GrammarMatcher:
        matcher = llg.LLMatcher(self.tokenizer, grammar_of(constraint), log_level=0)
        if matcher.is_error():
            raise _refuse(constraint.WhichOneof("kind"), matcher.get_error().strip())
        return GrammarMatcher(matcher, self._next_masks)

    def fill_bitmasks(self, matchers: Sequence[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
        """Write each matcher's allowed tokens into ``bitmask[row]`` (rows not named stay as they are):
        the masks computed in the background are copied, the others computed here in parallel on
        llguidance's threads (the GIL is released)."""
        missing = []
        for matcher, row in matchers:
            mask = matcher.computed_mask()
            if mask is None:
                missing.append((matcher.matcher, row))
            else:
                bitmask[row] = mask
        if missing:
            llg_numpy.fill_next_token_bitmask_par(self._executor, missing, bitmask)


BACKGROUND_MASKS_ENV = "OPENINFER_BACKGROUND_GRAMMAR_MASKS"


class CompilerCache:
    """The engine's lazily built compiler (loading the vocabulary takes a moment, so requests
    without constraints never pay for it). Masks are computed in the background unless the
    environment sets ``OPENINFER_BACKGROUND_GRAMMAR_MASKS=0`` when the engine is created (for
    side-by-side measurements: ``benchmarks/grammar_mask.py``)."""

    def __init__(self, tokenizer_dir: str, vocab_size: int, eos_token_ids: Sequence[int]):
        self._args = (tokenizer_dir, vocab_size, list(eos_token_ids))
        self._background_masks = os.environ.get(BACKGROUND_MASKS_ENV, "1") != "0"
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def get(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                try:
                    self._compiler = GrammarCompiler.from_dir(*self._args, background_masks=self._background_masks)
                except InvalidRequestError:
                    raise
                except (ValueError, OSError) as exc:  # a vocabulary llguidance cannot read
                    raise InvalidRequestError(
                        f"structured outputs are not available for this model: its tokenizer in "
                        f"{self._args[0]!r} cannot be read by the grammar engine ({exc})", FIELD) from exc
            return self._compiler


def allocate_bitmask(num_rows: int, vocab_size: int) -> np.ndarray:
    """All tokens allowed in every row."""
    return np.full((num_rows, bitmask_words(vocab_size)), -1, dtype=np.int32)


def allowed_tokens(bitmask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """A bool mask [vocab_size] from one bitmask row."""
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")
    return bits[:vocab_size].astype(bool)


# byte value → the 8 logit offsets its bits mean (0 allowed, -inf forbidden; bit 0 first)
_BYTE_OFFSETS = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1,
                         np.float32(0.0), np.float32(-np.inf)).astype(np.float32)
# a row whose allowed (or forbidden) tokens lie in at most 1/SPARSE_WORDS of its words is masked by
# index instead of through the table (a JSON state allows few tokens; a free string forbids few)
SPARSE_WORDS = 8


def _set_bits(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids of the set bits of ``words`` (ascending), below ``vocab_size``."""
    which = np.flatnonzero(words)
    positions = np.flatnonzero(np.unpackbits(words[which].view(np.uint8), bitorder="little"))
    ids = which[positions >> 5] * 32 + (positions & 31)
    return ids[ids < vocab_size]


def _apply_row(logits: np.ndarray, bitmask_row: np.ndarray) -> None:
    vocab = logits.shape[-1]
    sparse = bitmask_row.size // SPARSE_WORDS
    if np.count_nonzero(bitmask_row) <= sparse:  # few words allow anything
        allowed = _set_bits(bitmask_row, vocab)
        kept = logits[allowed]
        logits.fill(-np.inf)
        logits[allowed] = kept
    elif bitmask_row.size - np.count_nonzero(bitmask_row == -1) <= sparse:  # few words forbid anything
        logits[_set_bits(np.invert(bitmask_row), vocab)] = -np.inf
    else:
        # (np.take without ``out``: with one, it buffers the output and is several times slower)
        offsets = np.take(_BYTE_OFFSETS, bitmask_row.view(np.uint8), axis=0)
        np.add(logits, offsets.reshape(-1)[:vocab], out=logits)


def apply_bitmasks(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """Forbidden tokens' logits become -inf, in place: ``logits`` [rows, vocab] float32, ``bitmask``
    [rows, ceil(vocab / 32)] int32 (the packed layout above; bits past ``vocab`` are ignored).
    Allowed logits are left as they are. Per row, the cheapest of: writing the few allowed
    tokens into a row of -inf, writing -inf at the few forbidden ones, or one table gather and
    add over the row (a batch-wide gather is slower: its temporaries leave the cache)."""
    if logits.shape[0] != bitmask.shape[0]:
        raise ValueError(f"{logits.shape[0]} logits rows for {bitmask.shape[0]} bitmask rows")
    if bitmask.dtype != np.int32 or bitmask.shape[1] < bitmask_words(logits.shape[1]):
        raise ValueError(f"a bitmask for {logits.shape[1]} tokens is int32 [rows, >= {bitmask_words(logits.shape[1])}]")
    for row in range(logits.shape[0]):
        _apply_row(logits[row], bitmask[row])
    return logits


def apply_bitmask(logits: np.ndarray, bitmask_row: np.ndarray) -> np.ndarray:
    """:func:`apply_bitmasks` for one float32 row (in place)."""
    apply_bitmasks(logits[np.newaxis], bitmask_row[np.newaxis])
    return logits


LOGIT_BIAS_LIMIT = 100.0
