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
* after a step's tokens are read back, the engine hands them and the matchers of the step
  sampled next to :meth:`GrammarCompiler.start_masks` at once: on a background thread
  (:class:`MaskWorker`), one parallel llguidance call advances the matchers by their tokens and
  one fills their allowed-token bitmasks (one int32 word per 32 tokens, bit ``t % 32`` of word
  ``t // 32`` set = token ``t`` allowed), the GIL released, while the engine emits, schedules
  and builds the next batch and the device runs the forward (the first call is made by the
  engine thread itself unless ``OPENINFER_GRAMMAR_CONSUME_ON_WORKER=1``:
  :attr:`GrammarCompiler.tokens_consumed_on_worker` says why);
* on CUDA (unless ``OPENINFER_GRAMMAR_MASKS_DEVICE_WAIT=0``), a step with grammar rows is sampled
  ahead like any other, before its masks exist (:meth:`StepMasks.pending`): the GPU stream waits
  for them (``backend.cuda.sampler``), so neither the mask work nor the engine's host work lies
  between two device steps;
* the samplers apply the step's compact masks (:class:`StepMasks`): :func:`apply_bitmasks` on
  NumPy, one kernel for the whole batch on CUDA, rows with and without a grammar together.

JSON is generated compactly with Python's separators (``", "`` and ``": "``) and no other
whitespace, so a sampled output can neither stall in whitespace nor differ between paths.
"""

from __future__ import annotations

import atexit
import collections
import json
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
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


class TimingLog:
    """The last ``keep`` durations (ms) of something that happens once a step, and how many were
    logged in all: a benchmark takes the ones of its run (``last(count_after - count_before)``)."""

    def __init__(self, keep: int = 8192):
        self._recent: collections.deque[float] = collections.deque(maxlen=keep)
        self._count = 0
        self._lock = threading.Lock()

    def add(self, milliseconds: float) -> None:
        with self._lock:
            self._recent.append(milliseconds)
            self._count += 1

    @property
    def count(self) -> int:
        return self._count

    def last(self, count: int) -> list[float]:
        """The last ``count`` durations logged (at most ``keep``), oldest first."""
        with self._lock:
            kept = list(self._recent)
        return kept[len(kept) - min(count, len(kept)):] if count > 0 else []


# per step of background or pending masks: from GrammarCompiler.start_masks (the previous step's tokens
# read back, not yet consumed) until the masks are ready (the device released): the host's mask latency
MASK_LATENCIES = TimingLog()


class GrammarMatcher:
    """One request's position in its grammar. ``accept`` advances it by a sampled token; its next
    mask is computed with the other rows of its step (:meth:`GrammarCompiler.start_masks`)."""

    def __init__(self, matcher: llg.LLMatcher):
        self._matcher = matcher
        self._in_use: threading.Event | None = None  # set when a step's mask computation leaves it

    @property
    def matcher(self) -> llg.LLMatcher:
        return self._matcher

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; False when the grammar forbids it (the matcher is then in an
        error state: only a bug or an unconstrained token such as a forced stop gets here)."""
        self._wait_until_free()  # a mask computation may still read this state
        if self._matcher.is_stopped():
            return True  # the grammar is complete: the only tokens left are the stop tokens
        return self._matcher.consume_token(token_id)

    def is_terminated(self) -> bool:
        self._wait_until_free()
        return self._matcher.is_stopped()

    def fill(self, bitmask_row: np.ndarray) -> None:
        """This state's allowed tokens into one bitmask row, now."""
        self._wait_until_free()
        llg_numpy.fill_next_token_bitmask(self._matcher, bitmask_row.reshape(1, -1), 0)

    def _wait_until_free(self) -> None:
        if self._in_use is not None:
            self._in_use.wait()
            self._in_use = None


class StepMasks:
    """One step's grammar masks, compact: ``bitmask[j]`` is the allowed-token bitmask (layout
    below) of the logits row ``i`` with ``mask_rows[i] == j``; ``mask_rows[i] == -1`` for rows
    without a grammar. Computed on :class:`MaskWorker` (``wait`` returns when done) or at once."""

    def __init__(self, bitmask: np.ndarray, mask_rows: np.ndarray, done: threading.Event | None = None):
        self.bitmask = bitmask  # [constrained rows, words] int32
        self.mask_rows = mask_rows  # [rows] int32
        self._done = done
        self._failed = False
        self._started = True  # False for pending masks (see ``pending``) until they are started
        self._filled = done is None  # computed (or failed): the ready callbacks have run
        self._ready_callbacks: list = []
        self._lock = threading.Lock()
        self._started_at: float | None = None  # perf_counter() at start_masks (MASK_LATENCIES)

    @classmethod
    def pending(cls, rows: Sequence[int], num_rows: int, words: int) -> StepMasks:
        """The masks of the logits rows ``rows`` of a step sampled before its matchers consumed
        the previous step's tokens: a device sampler queues its sampling behind them
        (:meth:`when_ready`), :meth:`GrammarCompiler.start_masks` (``into``) computes them later."""
        mask_rows = np.full(num_rows, -1, np.int32)
        mask_rows[np.asarray(rows, dtype=np.int64)] = np.arange(len(rows), dtype=np.int32)
        masks = cls(np.empty((len(rows), words), np.int32), mask_rows, threading.Event())
        masks._started = False
        return masks

    @property
    def is_ready(self) -> bool:
        return self._filled

    @property
    def is_started(self) -> bool:
        return self._started

    def when_ready(self, callback) -> None:
        """Call ``callback(self)`` once the masks are computed (or failed: ``failed``), on the
        thread that finished them, or at once when they are."""
        with self._lock:
            if not self._filled:
                self._ready_callbacks.append(callback)
                return
        callback(self)

    def compute_into(self, buffer: np.ndarray) -> bool:
        """Pending masks not started yet are computed straight into ``buffer`` (e.g. pinned
        memory a device copies from; same shape and dtype); False when already started."""
        with self._lock:
            if self._started or buffer.shape != self.bitmask.shape or buffer.dtype != self.bitmask.dtype:
                return False
            self.bitmask = buffer
            return True

    @property
    def failed(self) -> bool:
        return self._failed

    def _finish(self, failed: bool = False) -> None:
        """Computed (or failed): run the ready callbacks, then wake the waiters."""
        with self._lock:
            self._failed = self._failed or failed
            self._filled = True
            callbacks, self._ready_callbacks = self._ready_callbacks, []
        for callback in callbacks:
            try:
                callback(self)
            except Exception:  # a device sampler's release: logged, the step fails at read-back
                logger.exception("a grammar-mask ready callback failed")
        if self._started_at is not None and not failed:  # (before the waiters wake: they may read it)
            MASK_LATENCIES.add((time.perf_counter() - self._started_at) * 1e3)
        if self._done is not None:
            self._done.set()

    def abandon(self) -> None:
        """Give up pending masks that were never started (their step's requests fail): every
        row allows everything, the ready callbacks run and ``wait`` raises."""
        with self._lock:
            if self._started:
                return
            self._started = True
        self.bitmask.fill(-1)
        self._finish(failed=True)

    @classmethod
    def from_rows(cls, bitmask: np.ndarray, constrained: Iterable[int]) -> StepMasks:
        """From a bitmask with one row per logits row, of which the rows ``constrained`` apply."""
        rows = np.asarray(sorted(set(constrained)), dtype=np.int64)
        mask_rows = np.full(bitmask.shape[0], -1, np.int32)
        mask_rows[rows] = np.arange(len(rows), dtype=np.int32)
        return cls(np.ascontiguousarray(bitmask[rows], dtype=np.int32), mask_rows)

    @property
    def constrained(self) -> list[int]:
        """The logits rows with a mask, ascending."""
        return np.flatnonzero(self.mask_rows >= 0).tolist()

    def wait(self) -> StepMasks:
        """The masks, once computed; raises ``RuntimeError`` when the computation failed."""
        if self._done is not None:
            self._done.wait()
        if self._failed:
            raise RuntimeError("computing the step's grammar masks failed (see the log)")
        return self

    def row(self, index: int) -> np.ndarray | None:
        j = self.mask_rows[index]
        return self.bitmask[j] if j >= 0 else None

    def subset(self, indices: Sequence[int]) -> StepMasks:
        """The masks of the logits rows ``indices``, renumbered 0..len(indices) - 1 (computed
        ones: ``wait`` first)."""
        return StepMasks(self.wait().bitmask, self.mask_rows[np.asarray(indices, dtype=np.int64)])


class MaskWorker:
    """The thread that computes a step's masks while the engine thread goes on: the engine hands
    over all of a step's matchers at once (:meth:`GrammarCompiler.start_masks`), right after they
    consumed the previous step's tokens; one llguidance call fills every mask in parallel on its
    executor, writing straight into the step's compact bitmask, the GIL released throughout. So
    the mask work runs on other cores during the engine's read-back, emission, scheduling and
    batch building for the next step, and the GPU's forward.

    The hand-over waits until the worker holds the job (a thread wake-up): a woken thread needs
    the GIL to start, and the engine thread, busy in Python, would give it up only at the next
    forced switch (``sys.getswitchinterval()``, 5 ms) — longer than the whole mask computation.

    At interpreter exit every instance is closed (:func:`atexit`) before the runtime is torn
    down: a daemon thread still inside llguidance then would write into freed memory."""

    IDLE_EXIT_S = 2.0

    def __init__(self, executor: llg.LLExecutor):
        self.executor = executor  # switched between steps only (GrammarCompiler.mask_threads)
        self._wakeup = threading.Condition()
        self._jobs: list[tuple[list[tuple[llg.LLMatcher, int]], list[tuple[llg.LLMatcher, int]], StepMasks,
                               threading.Event]] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        self._interval_held = False  # hold_switch_interval lowered the GIL switch interval
        _OPEN_MASK_WORKERS.add(self)

    def submit(self, consume: list[tuple[llg.LLMatcher, int]] | Callable[[], list[tuple[llg.LLMatcher, int]]],
               matchers: list[tuple[llg.LLMatcher, int]], masks: StepMasks) -> bool:
        """Advance the matchers of ``consume`` (matcher, token id) by their tokens, then fill
        ``masks.bitmask`` for ``matchers`` (matcher, bitmask row) and finish ``masks``; False when
        closed (nothing was started). ``consume`` may be a function returning those pairs, called
        on the worker first (it may wait: for the previous step's tokens)."""
        taken = threading.Event()
        with self._wakeup:
            if self._closed:
                return False
            self._jobs.append((consume, matchers, masks, taken))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="openinfer-grammar-masks", daemon=True)
                self._thread.start()
            else:
                self._wakeup.notify()
        taken.wait()
        return True

    def close(self) -> None:
        """Finish the masks under way and stop the thread."""
        with self._wakeup:
            self._closed = True
            thread = self._thread
            self._wakeup.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def hold_switch_interval(self, interval: float) -> None:
        """Lower the GIL switch interval to ``interval`` (:func:`gil_switch_interval_s`) until this
        worker is next idle: from the engine thread, before a step's tokens are consumed, so every
        hand-over of the GIL in the step's mask work (the caller's return from consuming, the
        worker's start and its return from filling) comes within ``interval``."""
        with self._wakeup:
            _lower_switch_interval(interval, already=self._interval_held)
            self._interval_held = True

    def release_switch_interval(self) -> None:
        """The interpreter's own interval again, if this worker lowered it (done by the worker
        itself when idle)."""
        with self._wakeup:
            self._release_switch_interval()

    def _release_switch_interval(self) -> None:
        """(holding ``_wakeup``) The interpreter's own interval again, if this worker lowered it."""
        if self._interval_held:
            _restore_switch_interval()
            self._interval_held = False

    def _run(self) -> None:
        try:
            while True:
                with self._wakeup:
                    if not self._jobs and not self._closed:
                        self._release_switch_interval()  # idle: nothing to hand over
                        self._wakeup.wait(self.IDLE_EXIT_S)
                    if not self._jobs:
                        self._thread = None
                        return
                    consume, matchers, masks, taken = self._jobs.pop(0)
                taken.set()
                failed = False
                try:
                    if callable(consume):
                        consume = consume()
                        masks._started_at = time.perf_counter()  # the masks' latency from the tokens on
                    fill_masks(self.executor, consume, matchers, masks.bitmask)
                except Exception:  # the engine then fails the step's requests (StepMasks.wait raises)
                    logger.exception("computing grammar masks in the background failed")
                    failed = True
                masks._finish(failed)
        finally:
            with self._wakeup:
                self._release_switch_interval()


# =N (microseconds): from the start of a step's background mask work (GrammarCompiler.start_masks)
# until the mask worker is idle again (without a worker: during start_masks' llguidance calls), the
# interpreter's GIL switch interval (sys.setswitchinterval,
# 5 ms by default) is N us. Each llguidance call returns needing the GIL, and the worker's start needs
# it too; when it is done the worker needs it to release the device (StepMasks._finish: the flag the
# GPU polls). A thread busy in Python (the engine's emission and scheduling, the frontend's event
# loop) hands the GIL over only when it blocks or when the interval ends, so a late hand-over idles
# the GPU. Read at every step (switchable between runs); unset: GIL_SWITCH_INTERVAL_DEFAULT_US, "0": the
# interval is left alone. Default by two H200 windows (grammar_mask.py overhead, batch 64, every row
# under a JSON schema): TPOT +5.1 -> +4.4 % (E2) and +7.1 -> +4.6 % (E3) over no schema.
GIL_SWITCH_INTERVAL_ENV = "OPENINFER_GRAMMAR_GIL_SWITCH_INTERVAL_US"
GIL_SWITCH_INTERVAL_DEFAULT_US = "200"


def gil_switch_interval_s() -> float | None:
    """``OPENINFER_GRAMMAR_GIL_SWITCH_INTERVAL_US`` in seconds (unset or empty: the default,
    ``GIL_SWITCH_INTERVAL_DEFAULT_US``), or None (0 or invalid: the interval is left alone; an
    invalid value is logged once)."""
    raw = os.environ.get(GIL_SWITCH_INTERVAL_ENV, "").strip() or GIL_SWITCH_INTERVAL_DEFAULT_US
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value >= 0 and value == value):
        if raw not in _REPORTED_INTERVALS:
            _REPORTED_INTERVALS.add(raw)
            logger.warning("%s=%r is not a number of microseconds; the GIL switch interval is left alone",
                           GIL_SWITCH_INTERVAL_ENV, raw)
        return None
    return value / 1e6 if value > 0 else None


_REPORTED_INTERVALS: set[str] = set()

# =1: with the device waiting for grammar masks, a step sampled ahead hands its pending masks to the
# mask worker at once, before the previous step is read back (GrammarCompiler.start_masks_after): the
# worker waits for the tokens itself, so the mask work starts when the device has sampled them even
# while the engine thread is still busy in Python. Read at every step; opt-in until measured on a GPU
EARLY_MASKS_ENV = "OPENINFER_GRAMMAR_EARLY_MASKS"


def early_grammar_masks() -> bool:
    """Whether ``OPENINFER_GRAMMAR_EARLY_MASKS=1`` is set (now)."""
    return os.environ.get(EARLY_MASKS_ENV) == "1"


_SWITCH_INTERVAL_LOCK = threading.Lock()
_switch_interval_users = 0  # mask workers holding the interval lowered
_saved_switch_interval = 0.0  # the interpreter's interval before the first of them


def _lower_switch_interval(interval: float, already: bool) -> None:
    """The GIL switch interval becomes ``interval`` for a mask worker (``already``: it holds it)."""
    global _switch_interval_users, _saved_switch_interval
    with _SWITCH_INTERVAL_LOCK:
        if not already:
            if _switch_interval_users == 0:
                _saved_switch_interval = sys.getswitchinterval()
            _switch_interval_users += 1
        sys.setswitchinterval(interval)


def _restore_switch_interval() -> None:
    """A mask worker lets go of the lowered interval; the last one restores the interpreter's."""
    global _switch_interval_users
    with _SWITCH_INTERVAL_LOCK:
        _switch_interval_users -= 1
        if _switch_interval_users == 0:
            sys.setswitchinterval(_saved_switch_interval)


def consume_tokens(executor: llg.LLExecutor, consume: Sequence[tuple[llg.LLMatcher, int]]) -> None:
    """Advance each matcher by its token, in parallel (the GIL released), as
    :meth:`GrammarMatcher.accept` does one: a completed grammar consumes nothing (what follows
    is a stop token), a forbidden token leaves the matcher in its error state (logged)."""
    live = [(matcher, token) for matcher, token in consume if not matcher.is_stopped()]
    if not live:
        return
    accepted = llg_numpy.consume_token_par(executor, live)
    for (matcher, token), ok in zip(live, accepted, strict=True):
        if not ok:
            logger.warning("the grammar refused token %d: %s", token, matcher.get_error())


def fill_masks(executor: llg.LLExecutor, consume: Sequence[tuple[llg.LLMatcher, int]],
               matchers: list[tuple[llg.LLMatcher, int]], bitmask: np.ndarray) -> None:
    """``consume_tokens(consume)``, then each matcher's allowed tokens into ``bitmask[row]``."""
    if consume:
        consume_tokens(executor, consume)
    if matchers:
        llg_numpy.fill_next_token_bitmask_par(executor, matchers, bitmask)


_OPEN_MASK_WORKERS: weakref.WeakSet[MaskWorker] = weakref.WeakSet()


@atexit.register
def _close_mask_workers() -> None:
    for worker in list(_OPEN_MASK_WORKERS):
        worker.close()


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


# =N: llguidance's threads for a step's masks (default: default_mask_threads), read when the engine is
# created (engine.grammar_mask_threads switches it)
MASK_THREADS_ENV = "OPENINFER_GRAMMAR_MASK_THREADS"


def mask_threads_from_environment(default: int) -> int:
    """``OPENINFER_GRAMMAR_MASK_THREADS`` when set to a positive integer, else ``default`` (an invalid
    value is logged)."""
    raw = os.environ.get(MASK_THREADS_ENV, "").strip()
    if not raw:
        return default
    if raw.isdigit() and int(raw) >= 1:
        return int(raw)
    logger.warning("%s=%r is not a positive integer; %d mask threads", MASK_THREADS_ENV, raw, default)
    return default


def default_mask_threads(device_forward: bool) -> int:
    """Threads filling a step's masks in parallel: with the forward on a GPU every core but two
    (the engine thread and the frontend's) up to 16; with the forward on the CPU half the cores
    (its BLAS threads need the others)."""
    cores = os.cpu_count() or 2
    return max(2, min(16, cores - 2)) if device_forward else max(2, min(8, cores // 2))


# one character of a JSON string that needs no escape
_STRING_CHARACTER = '[^"\\\\\\x00-\\x1F\\x7F]'


def string_length_slices() -> list[str]:
    """llguidance's token "slices" (``LLTokenizer.general_slices``: JSON whitespace, then tokens
    of 1-10, 11-30 and more unescaped string characters) with the 1-10 slice split by length.
    A mask walks the token trie except the slices the lexer state accepts whole; inside a string
    of bounded length (``maxLength``: ``"name"`` of the benchmark's ``PERSON``) with fewer than
    10 characters left, no slice of the general set is accepted whole and the mask walks all
    152k tokens of a Qwen3 vocabulary (2-4 ms a row), while here the lengths that still fit are
    taken at once. Same masks either way."""
    return (['[\\x20\\x0A\\x0D\\x09]+'] + [f"{_STRING_CHARACTER}{{1,{n}}}" for n in range(1, 11)]
            + [f"{_STRING_CHARACTER}{{1,30}}", f"{_STRING_CHARACTER}+"])


_STRING_LENGTH_SLICES = string_length_slices()


class GrammarCompiler:
    """Builds matchers for one vocabulary. ``vocab_size`` is the model's (logit rows may be wider
    than the tokenizer: padding ids are never allowed)."""

    tokens_consumed_on_worker: bool
    """With background masks, where :meth:`start_masks` advances the matchers by the previous
    step's tokens: True, on the worker, in the same job as the fill (the caller returns at
    once); False, on the calling thread first (in parallel, the GIL released: it waits that
    long). On the worker the two llguidance calls have Python between them, so the worker needs
    the GIL back after consuming, and an engine thread busy in Python (emitting, scheduling,
    building the next batch) gives it up only when it blocks or at the next forced switch
    (``sys.getswitchinterval()``, 5 ms): the fill then starts after the engine's work instead
    of beside it. Switchable between steps."""

    string_length_slices: bool
    """New matchers mask through :func:`string_length_slices` instead of llguidance's general
    slices (the same masks, less work near the end of a length-bounded string). Switchable
    between requests (the other tokenizer is built when first asked for); on by default."""

    def __init__(self, tokenizer: str | llg.LLTokenizer, vocab_size: int, eos_token_ids: Sequence[int] = (),
                 background_masks: bool = True, mask_threads: int | None = None,
                 tokens_consumed_on_worker: bool = False, string_length_slices: bool = True):
        """``tokenizer``: the text of a ``tokenizer.json``, or an llguidance tokenizer (with the
        general slices); ``background_masks``: :meth:`start_masks` computes a step's masks on a
        background thread (:class:`MaskWorker`); off, on the calling thread before it returns;
        ``mask_threads``: llguidance's threads for a step's masks (default :func:`mask_threads`);
        ``tokens_consumed_on_worker``, ``string_length_slices``: the switches of the same names."""
        self.vocab_size = vocab_size
        self.tokens_consumed_on_worker = tokens_consumed_on_worker
        self.string_length_slices = string_length_slices
        # the tokenizers new matchers use, by ``string_length_slices``
        self._tokenizers: dict[bool, llg.LLTokenizer] = {}
        if isinstance(tokenizer, str):
            sliced = string_length_slices
            tokenizer = llg.LLTokenizer(grammar_tokenizer_json(tokenizer), n_vocab=vocab_size,
                                        eos_token=list(eos_token_ids) or None,
                                        slices=_STRING_LENGTH_SLICES if sliced else None)
        else:
            sliced = False
        self._tokenizers[sliced] = tokenizer
        self._tokenizers_lock = threading.Lock()
        self._mask_threads = mask_threads or default_mask_threads(device_forward=False)
        self._executor = llg.LLExecutor(num_threads=self._mask_threads)
        self._worker = MaskWorker(self._executor) if background_masks else None

    @property
    def mask_threads(self) -> int:
        """llguidance's threads for a step's masks. Switchable between steps (a new thread pool)."""
        return self._mask_threads

    @mask_threads.setter
    def mask_threads(self, value: int) -> None:
        value = int(value)
        if value < 1:
            raise ValueError(f"mask_threads must be >= 1, got {value}")
        if value != self._mask_threads:
            self._executor = llg.LLExecutor(num_threads=value)
            if self._worker is not None:
                self._worker.executor = self._executor
            self._mask_threads = value

    @classmethod
    def from_dir(cls, tokenizer_dir: str, vocab_size: int, eos_token_ids: Sequence[int],
                 background_masks: bool = True, mask_threads: int | None = None,
                 tokens_consumed_on_worker: bool = False, string_length_slices: bool = True) -> GrammarCompiler:
        """From ``tokenizer.json``, or a tiktoken vocabulary (``tiktoken.model``: Kimi-K2)."""
        directory = Path(tokenizer_dir)
        switches = {"tokens_consumed_on_worker": tokens_consumed_on_worker,
                    "string_length_slices": string_length_slices}
        if (directory / "tokenizer.json").is_file():
            return cls((directory / "tokenizer.json").read_text(encoding="utf-8"), vocab_size, eos_token_ids,
                       background_masks, mask_threads, **switches)
        if (directory / "tiktoken.model").is_file():
            from openinfer.tiktoken_tokenizer import tiktoken_encoding

            config_path = directory / "tokenizer_config.json"
            config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
            encoding = tiktoken_encoding(directory, config)
            return cls(llg.LLTokenizer.from_tiktoken(
                encoder=encoding._mergeable_ranks, special_tokens=encoding._special_tokens,
                pattern=encoding._pat_str, eos_token=list(eos_token_ids) or encoding.eot_token,
                n_vocab=vocab_size), vocab_size, background_masks=background_masks, mask_threads=mask_threads,
                **switches)
        raise InvalidRequestError(
            f"structured outputs need the model's tokenizer (tokenizer.json or tiktoken.model), which is not in "
            f"{tokenizer_dir!r}; serve a model directory with a tokenizer (or pass --tokenizer)", FIELD)

    def _matcher_tokenizer(self) -> llg.LLTokenizer:
        """The tokenizer new matchers use: with :func:`string_length_slices` when
        ``string_length_slices`` is set, else llguidance's general slices (a matcher keeps its own)."""
        sliced = self.string_length_slices
        with self._tokenizers_lock:
            tokenizer = self._tokenizers.get(sliced)
            if tokenizer is None:
                built = next(iter(self._tokenizers.values()))
                tokenizer = self._tokenizers[sliced] = built.with_slices(
                    _STRING_LENGTH_SLICES if sliced else llg.LLTokenizer.general_slices())
            return tokenizer

    def compile(self, constraint: pb.StructuredOutput) -> GrammarMatcher:
        matcher = llg.LLMatcher(self._matcher_tokenizer(), grammar_of(constraint), log_level=0)
        if matcher.is_error():
            raise _refuse(constraint.WhichOneof("kind"), matcher.get_error().strip())
        return GrammarMatcher(matcher)

    def start_masks(self, matchers: Sequence[tuple[GrammarMatcher, int]], num_rows: int,
                    background: bool = True, consume: Sequence[tuple[GrammarMatcher, int]] = (),
                    into: StepMasks | None = None) -> StepMasks:
        """Start computing the masks of one step of ``num_rows`` logits rows, ``matchers`` giving
        (matcher, logits row): with ``background`` and a worker, on the worker (``wait()`` on the
        result before reading it; the matchers wait too before they consume a token), else here,
        in parallel on llguidance's threads (the GIL is released). ``consume``: (matcher, token
        id) pairs to advance first, in the same job (the previous step's tokens, read back just
        now). ``into``: pending masks (:meth:`StepMasks.pending`) to compute, whose rows not in
        ``matchers`` (requests finished meanwhile) allow everything."""
        started_at = time.perf_counter()
        if into is None:
            masks = StepMasks.pending([row for _, row in matchers], num_rows, bitmask_words(self.vocab_size))
            masks._started = True
        else:
            masks = into
            with masks._lock:
                if masks._started:
                    raise RuntimeError("these grammar masks were started already")
                masks._started = True
        masks._started_at = started_at
        work = [(m.matcher, j) for m, row in matchers if (j := int(masks.mask_rows[row])) >= 0]
        if into is not None and len(work) < len(masks.bitmask):  # rows finished meanwhile allow everything
            idle = np.ones(len(masks.bitmask), bool)
            idle[[j for _, j in work]] = False
            masks.bitmask[idle] = -1
        taken = [(m.matcher, int(token)) for m, token in consume]
        busy = {id(m): m for m, _ in matchers} | {id(m): m for m, _ in consume}
        for matcher in busy.values():
            matcher._wait_until_free()
        on_worker = background and self._worker is not None
        interval = gil_switch_interval_s()
        if interval is not None and on_worker:  # until the worker is idle
            self._worker.hold_switch_interval(interval)
        if on_worker and taken and not self.tokens_consumed_on_worker:
            try:  # here, in parallel with the GIL released: the worker then needs no GIL until its fill ends
                consume_tokens(self._executor, taken)
            except BaseException:
                masks.bitmask.fill(-1)  # a device waiting for these masks is released; sampling fails
                masks._finish(failed=True)
                self._worker.release_switch_interval()
                raise
            taken = []
        if on_worker:
            for matcher in busy.values():
                matcher._in_use = masks._done
            if self._worker.submit(taken, work, masks):
                return masks
            for matcher in busy.values():  # the worker is closed: computed here
                matcher._in_use = None
            self._worker.release_switch_interval()  # it will not run again to do it
        elif interval is not None:  # computed here: the GIL comes back within the interval
            _lower_switch_interval(interval, already=False)
        try:
            fill_masks(self._executor, taken, work, masks.bitmask)
        except BaseException:
            masks._finish(failed=True)
            raise
        finally:
            if interval is not None and not on_worker:
                _restore_switch_interval()
        masks._finish()
        return masks

    def start_masks_after(self, tokens: Callable[[], Sequence[int]], consumers: Sequence[GrammarMatcher],
                          matchers: Sequence[tuple[GrammarMatcher, int]], into: StepMasks) -> bool:
        """:meth:`start_masks` (``into``) of a step sampled ahead, handed to the mask worker before
        the previous step is read back: there ``tokens()`` waits for that step's tokens (one per
        matcher of ``consumers``, in order), the consumers consume them and the masks are filled, so
        the mask work starts when the device has sampled, whatever the calling thread does then.
        False (nothing started, ``into`` untouched) without a worker; raises when ``into`` was
        started already. The consumers and matchers wait for the job before any other use."""
        if self._worker is None:
            return False
        masks = into
        with masks._lock:
            if masks._started:
                raise RuntimeError("these grammar masks were started already")
            masks._started = True
        work = [(m.matcher, j) for m, row in matchers if (j := int(masks.mask_rows[row])) >= 0]
        if len(work) < len(masks.bitmask):  # rows finished meanwhile allow everything
            idle = np.ones(len(masks.bitmask), bool)
            idle[[j for _, j in work]] = False
            masks.bitmask[idle] = -1
        busy = {id(m): m for m, _ in matchers} | {id(m): m for m in consumers}
        for matcher in busy.values():
            matcher._wait_until_free()
        interval = gil_switch_interval_s()
        if interval is not None:
            self._worker.hold_switch_interval(interval)
        consumed = [m.matcher for m in consumers]

        def consume() -> list[tuple[llg.LLMatcher, int]]:
            ids = list(tokens())
            if len(ids) != len(consumed):
                raise RuntimeError(f"{len(ids)} tokens for {len(consumed)} grammar matchers")
            return list(zip(consumed, (int(t) for t in ids), strict=True))

        for matcher in busy.values():
            matcher._in_use = masks._done
        if self._worker.submit(consume, work, masks):
            return True
        for matcher in busy.values():  # the worker is closed: the caller starts them later
            matcher._in_use = None
        self._worker.release_switch_interval()
        with masks._lock:
            masks._started = False
        return False

    def fill_bitmasks(self, matchers: Sequence[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
        """Write each matcher's allowed tokens into ``bitmask[row]`` now (rows not named stay as
        they are), in parallel on llguidance's threads (the GIL is released)."""
        for matcher, _ in matchers:
            matcher._wait_until_free()
        llg_numpy.fill_next_token_bitmask_par(self._executor, [(m.matcher, row) for m, row in matchers], bitmask)


BACKGROUND_MASKS_ENV = "OPENINFER_BACKGROUND_GRAMMAR_MASKS"
# The three switches below are on by default since an H200 run at batch 64, every row under the
# benchmark's schema (benchmarks/grammar_mask.py overhead --device cuda, D2 2026-11-23, 3 alternating
# rounds, benchmarks/results/grammar_mask_cuda_d2_h200.json): TPOT plain 4.04 ms; the former default
# (the worker consumes, general slices, the engine thread waits for the masks) 5.43 ms (+34 %); the
# engine thread consuming 5.34 ms (+32 %); and with the length slices 4.92 ms (+22 %); or with the GPU
# waiting 4.83 ms (+20 %); all three on (D3, 5 rounds, grammar_mask_cuda_d3_h200.json): 4.23 ms against
# plain 3.89 (+8.8 %), the former default 5.61 (+44 %). Each is read when the engine is created and can be
# switched on it.
# =1: the mask worker advances the matchers by a step's tokens before filling (the former default);
# else the engine thread does, in parallel with the GIL released, before handing the fill over
# (GrammarCompiler.tokens_consumed_on_worker)
CONSUME_ON_WORKER_ENV = "OPENINFER_GRAMMAR_CONSUME_ON_WORKER"
# =0: matchers mask through llguidance's general slices instead of string_length_slices() (same masks,
# more work in length-bounded strings; engine.grammar_string_length_slices)
STRING_LENGTH_SLICES_ENV = "OPENINFER_GRAMMAR_STRING_LENGTH_SLICES"
# =0: on CUDA, grammar rows wait for their masks on the host before their sampling is queued (the
# former default); else they are sampled ahead like the others and the GPU waits for their masks
# (``backend.cuda.sampler``). On an H100 (W3a, worker consuming) it measured +26 % against +20 %,
# noisy; on the H200 with the engine thread consuming, faster in each of 3 rounds (above)
DEVICE_WAIT_ENV = "OPENINFER_GRAMMAR_MASKS_DEVICE_WAIT"


class CompilerCache:
    """The engine's lazily built compiler (loading the vocabulary takes a moment, so requests
    without constraints never pay for it). Masks are computed in the background unless the
    environment sets ``OPENINFER_BACKGROUND_GRAMMAR_MASKS=0`` when the engine is created (for
    side-by-side measurements: ``benchmarks/grammar_mask.py``)."""

    def __init__(self, tokenizer_dir: str, vocab_size: int, eos_token_ids: Sequence[int], device_forward: bool = False):
        """``device_forward``: the model runs on a GPU (more cores for the masks)."""
        self._args = (tokenizer_dir, vocab_size, list(eos_token_ids))
        self._mask_threads = mask_threads_from_environment(default_mask_threads(device_forward))
        self._background_masks = os.environ.get(BACKGROUND_MASKS_ENV, "1") != "0"
        self._tokens_consumed_on_worker = os.environ.get(CONSUME_ON_WORKER_ENV, "0") == "1"
        self._string_length_slices = os.environ.get(STRING_LENGTH_SLICES_ENV, "1") != "0"
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    @property
    def tokens_consumed_on_worker(self) -> bool:
        """:attr:`GrammarCompiler.tokens_consumed_on_worker` of the compiler (built or to be built)."""
        return self._tokens_consumed_on_worker

    @tokens_consumed_on_worker.setter
    def tokens_consumed_on_worker(self, value: bool) -> None:
        with self._lock:
            self._tokens_consumed_on_worker = bool(value)
            if self._compiler is not None:
                self._compiler.tokens_consumed_on_worker = self._tokens_consumed_on_worker

    @property
    def mask_threads(self) -> int:
        """:attr:`GrammarCompiler.mask_threads` of the compiler (built or to be built)."""
        return self._mask_threads

    @mask_threads.setter
    def mask_threads(self, value: int) -> None:
        if int(value) < 1:
            raise ValueError(f"mask_threads must be >= 1, got {value}")
        with self._lock:
            self._mask_threads = int(value)
            if self._compiler is not None:
                self._compiler.mask_threads = self._mask_threads

    @property
    def string_length_slices(self) -> bool:
        """:attr:`GrammarCompiler.string_length_slices` of the compiler (built or to be built)."""
        return self._string_length_slices

    @string_length_slices.setter
    def string_length_slices(self, value: bool) -> None:
        with self._lock:
            self._string_length_slices = bool(value)
            if self._compiler is not None:
                self._compiler.string_length_slices = self._string_length_slices

    def get(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                try:
                    self._compiler = GrammarCompiler.from_dir(
                        *self._args, background_masks=self._background_masks, mask_threads=self._mask_threads,
                        tokens_consumed_on_worker=self._tokens_consumed_on_worker,
                        string_length_slices=self._string_length_slices)
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
