"""Per-request traces as Chrome-trace JSON (open in https://ui.perfetto.dev or chrome://tracing).

Off unless a trace directory is given (``--trace-dir`` / ``EngineOptions.trace_dir``). Two sides
record, each in the process that does the work, so the hooks survive the engine moving into
its own process:

* the engine (``EngineTracer``) records, per request, its time in the queue, each prefill chunk
  and each decode step it rode in (batch size, tokens in the step, step time), and on finish
  writes ``<request_id>.engine.json``;
* the frontend (``FrontendTracer``) records the request as the API server sees it: its whole
  life, each detokenize and each stream write; on finish it writes ``<request_id>.json`` with
  its own spans and the engine's (merged from ``<request_id>.engine.json``, which it removes).
  When no frontend traces (CLI, gRPC), the engine file alone is the request's trace.

Files are written by one background thread per process (``TraceWriter``), so neither the
engine loop nor the event loop ever waits on JSON or the disk. Timestamps are wall-clock
microseconds (``time.time``), the one clock two processes on one host share.

Span layout (``ph: "X"`` complete events; on each track spans nest, never overlap partially)::

    track "engine":    engine ⊃ queue, prefill (one per chunk), decode (one per step), preempted
    track "frontend":  request ⊃ detokenize, stream
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openinfer.errors import OpenInferError

logger = logging.getLogger("openinfer.tracing")

_PID = 1
ENGINE_TID = 1
FRONTEND_TID = 2
# how long the frontend's writer waits for the engine's half of a trace before writing its own alone
ENGINE_PART_WAIT_S = 5.0


def _now_us() -> float:
    return time.time() * 1e6


def _span(name: str, tid: int, start_us: float, end_us: float, args: str = "") -> str:
    """One complete event as JSON text (built by hand: the writer formats thousands per second)."""
    # in tenths of a microsecond, start and end rounded alike, so children stay inside parents
    start, end = int(start_us * 10 + 0.5), int(end_us * 10 + 0.5)
    tail = f',"args":{args}}}' if args else "}"
    return f'{{"name":"{name}","ph":"X","pid":{_PID},"tid":{tid},"ts":{start / 10},"dur":{max(0, end - start) / 10}{tail}'


def _metadata(request_id: str) -> list[str]:
    return [json.dumps({"name": "process_name", "ph": "M", "pid": _PID, "args": {"name": f"request {request_id}"}}),
            f'{{"name":"thread_name","ph":"M","pid":{_PID},"tid":{ENGINE_TID},"args":{{"name":"engine"}}}}',
            f'{{"name":"thread_name","ph":"M","pid":{_PID},"tid":{FRONTEND_TID},"args":{{"name":"frontend"}}}}']


_HEAD = '{"traceEvents":['
_TAIL = '],"displayTimeUnit":"ms","otherData":'


def _document(events: list[str], other: dict[str, Any]) -> str:
    return _HEAD + ",".join(events) + _TAIL + json.dumps(other) + "}"


def _split_document(text: str) -> tuple[str, dict[str, Any]]:
    """A document ``_document`` wrote: (its events as JSON text, its otherData)."""
    head, marker, other = text.rpartition(_TAIL)
    if not marker or not head.startswith(_HEAD):
        raise ValueError("not a trace document written by openinfer.tracing")
    return head[len(_HEAD):], json.loads(other[:-1])


def safe_file_stem(request_id: str) -> str:
    """A request id as a file name: anything but letters, digits, '-', '_' and '.' becomes '_'."""
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in request_id)[:200]
    return stem.lstrip(".") or "request"


class TraceWriter:
    """Writes traces from a daemon thread; ``flush()`` waits until everything queued is on disk."""

    def __init__(self, trace_dir: str | os.PathLike):
        self.trace_dir = Path(trace_dir)
        try:
            self.trace_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OpenInferError(f"cannot create the trace directory {str(trace_dir)!r}: {exc.strerror or exc}; "
                                 "pass a writable --trace-dir") from exc
        if not os.access(self.trace_dir, os.W_OK):
            raise OpenInferError(f"the trace directory {str(trace_dir)!r} is not writable; pass a writable --trace-dir")
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="openinfer-trace-writer", daemon=True)
        self._thread.start()

    def engine_path(self, request_id: str) -> Path:
        return self.trace_dir / f"{safe_file_stem(request_id)}.engine.json"

    def path(self, request_id: str) -> Path:
        return self.trace_dir / f"{safe_file_stem(request_id)}.json"

    def submit(self, kind: str, request_id: str, build: Any, meta: dict[str, Any]) -> None:
        """Queue one side of a request's trace; ``build()`` returns its events as JSON text."""
        with self._idle:
            self._pending += 1
        self._queue.put((kind, request_id, build, meta, time.monotonic()))

    def flush(self, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                requeue = self._write(*item)
            except Exception:  # a trace must never take the server down
                logger.exception("writing the trace of request %r failed", item[1])
                requeue = False
            if requeue:
                time.sleep(0.01)
                self._queue.put(item)
                continue
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

    def _write(self, kind: str, request_id: str, build: Any, meta: dict[str, Any], queued: float) -> bool:
        """Write one side's events (``build()`` makes them, here, off the caller's loop); True
        when the frontend's side should wait for the engine's."""
        meta = dict(meta)
        expect_engine = meta.pop("expect_engine", True)
        other = {"request_id": request_id, **meta}
        if kind == "engine":
            _write_atomic(self.engine_path(request_id), _document(_metadata(request_id) + build(), other))
            return False
        engine_part = self.engine_path(request_id)
        if not engine_part.exists():
            if expect_engine and time.monotonic() - queued < ENGINE_PART_WAIT_S:
                return True
            _write_atomic(self.path(request_id), _document(_metadata(request_id) + build(), other))
            return False
        engine_events, engine_other = _split_document(engine_part.read_text())
        _write_atomic(self.path(request_id), _document([engine_events, *build()], {**engine_other, **other}))
        engine_part.unlink(missing_ok=True)
        return False


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# --- the engine's side --------------------------------------------------------------------------


class _StepRecord:
    """One launched engine step, shared by every request that rode in it: its chunks and each
    chunk's start position as of the launch (``num_computed_tokens`` moves on launch)."""

    __slots__ = ("launched_us", "chunks", "starts", "index", "resolved_us", "_tokens", "_args", "_rows")

    def __init__(self, launched_us: float, chunks: list, starts: list[int], index: int):
        self.launched_us = launched_us
        self.chunks = chunks
        self.starts = starts
        self.index = index
        self.resolved_us = 0.0
        self._tokens = -1
        self._args = ""
        self._rows: dict[str, int] | None = None

    def row_of(self, request_id: str) -> int | None:
        """This request's chunk in the step, if it rode in it (the map is built once per step,
        by the writer thread, off the engine loop)."""
        if self._rows is None:
            self._rows = {c.request.request_id: i for i, c in enumerate(self.chunks)}
        return self._rows.get(request_id)

    @property
    def args_prefix(self) -> str:
        """The step's own span arguments as JSON text, formatted once for all its requests."""
        if not self._args:
            self._args = (f'{{"step":{self.index},"batch_size":{len(self.chunks)},"batch_tokens":{self.batch_tokens},'
                          f'"step_ms":{round((self.resolved_us - self.launched_us) / 1e3, 3)},')
        return self._args

    @property
    def batch_tokens(self) -> int:
        if self._tokens < 0:  # once per step, by the first request written that rode in it
            self._tokens = sum(c.num_tokens for c in self.chunks)
        return self._tokens


@dataclass
class _EngineRequestTrace:
    arrival_us: float
    first_step: int  # steps resolved before it arrived cannot hold it
    scheduled_us: float | None = None
    preempted_us: list[float] = field(default_factory=list)
    rides: list[tuple[_StepRecord, int]] = field(default_factory=list)  # filled by the writer


class EngineTracer:
    """The engine loop's hooks: ``on_arrival``, ``on_scheduled``, ``on_preempted``, ``on_launch``
    (returns the step's record), ``on_resolved`` and ``on_finish``. Per step the loop pays one
    record and one snapshot of the chunks' start positions, whatever the batch size; which steps a
    request rode in is worked out, and its events built and written, when it finishes, off the loop.

    Resolved steps are kept in order (``_steps``, the first at global index ``_base``) for as long
    as a live request may have ridden in them."""

    PRUNE_EVERY = 256  # steps between drops of the steps no live request can need

    def __init__(self, writer: TraceWriter):
        self.writer = writer
        self._requests: dict[str, _EngineRequestTrace] = {}
        self._num_steps = 0
        self._steps: list[_StepRecord] = []
        self._base = 0

    def on_arrival(self, request_id: str) -> None:
        self._requests[request_id] = _EngineRequestTrace(_now_us(), self._base + len(self._steps))

    def on_scheduled(self, request_id: str) -> None:
        trace = self._requests.get(request_id)
        if trace is not None and trace.scheduled_us is None:
            trace.scheduled_us = _now_us()

    def on_preempted(self, request_id: str) -> None:
        trace = self._requests.get(request_id)
        if trace is not None:
            trace.preempted_us.append(_now_us())

    def on_launch(self, chunks: list) -> _StepRecord:
        """Called before the step's batch is built: snapshots each chunk's start (it moves on launch)."""
        self._num_steps += 1
        return _StepRecord(_now_us(), chunks, [c.request.num_computed_tokens for c in chunks], self._num_steps)

    def on_resolved(self, step: _StepRecord) -> None:
        """The step's tokens are on the host: it counts for every request still running then (a
        request finished before reads only the steps resolved before its finish, so a row launched
        ahead for it and discarded is not counted)."""
        step.resolved_us = _now_us()
        self._steps.append(step)
        if len(self._steps) % self.PRUNE_EVERY == 0:
            self._prune()

    def _prune(self) -> None:
        oldest = min((t.first_step for t in self._requests.values()), default=self._base + len(self._steps))
        drop = oldest - self._base
        if drop > 0:
            del self._steps[:drop]
            self._base += drop

    def on_finish(self, request_id: str, reason: str, prompt_tokens: int, completion_tokens: int,
                  cached_tokens: int) -> None:
        trace = self._requests.pop(request_id, None)
        if trace is None:
            return
        end = _now_us()
        meta = {"finish_reason": reason, "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "cached_tokens": cached_tokens}
        window = self._steps[max(0, trace.first_step - self._base):]  # the steps resolved while it lived

        def build() -> list[str]:
            for step in window:
                row = step.row_of(request_id)
                if row is not None:
                    trace.rides.append((step, row))
            return _engine_events(trace, end, meta)

        self.writer.submit("engine", request_id, build, {"engine": meta})


def _engine_events(trace: _EngineRequestTrace, end_us: float, meta: dict[str, Any]) -> list[str]:
    events = [_span("engine", ENGINE_TID, trace.arrival_us, end_us, json.dumps(meta))]
    scheduled = trace.scheduled_us if trace.scheduled_us is not None else end_us
    events.append(_span("queue", ENGINE_TID, trace.arrival_us, scheduled))
    cursor = scheduled
    prompt_tokens = meta["prompt_tokens"]
    generated = 0  # a chunk samples when it reaches the end of prompt + tokens generated so far
    # in tenths of a microsecond (as _span): a request's spans are built here by the thousand
    cursor10 = int(cursor * 10 + 0.5)
    end10 = int(end_us * 10 + 0.5)
    append = events.append
    for step, row in trace.rides:
        start, num_tokens = step.starts[row], step.chunks[row].num_tokens
        sampled = start + num_tokens >= prompt_tokens + generated
        generated += sampled
        # with async scheduling step N+1 is launched before N is read back: a request's rides
        # are cut where its previous one ended, so they follow each other on its track
        begin10 = int(step.launched_us * 10 + 0.5)
        if begin10 < cursor10:
            begin10 = cursor10
        finish10 = int(step.resolved_us * 10 + 0.5)
        if finish10 < begin10:
            finish10 = begin10
        if finish10 > end10:
            finish10 = end10
        name = "prefill" if num_tokens > 1 or start < prompt_tokens else "decode"
        append(f'{{"name":"{name}","ph":"X","pid":{_PID},"tid":{ENGINE_TID},"ts":{begin10 / 10},'
               f'"dur":{(finish10 - begin10) / 10},"args":{step.args_prefix}"position":{start},'
               f'"tokens":{num_tokens},"sampled":{"true" if sampled else "false"}}}}}')
        cursor10 = finish10
    for at in trace.preempted_us:
        events.append(f'{{"name":"preempted","ph":"i","s":"t","pid":{_PID},"tid":{ENGINE_TID},"ts":{round(at, 1)}}}')
    return events


# --- the frontend's side ------------------------------------------------------------------------


class FrontendTracer:
    """Opens a ``FrontendRequestTrace`` per request; all of them share one writer."""

    def __init__(self, writer: TraceWriter, *, expect_engine_part: bool = True):
        self.writer = writer
        self.expect_engine_part = expect_engine_part

    def open(self, request_id: str, arrival_time: float | None = None) -> FrontendRequestTrace:
        return FrontendRequestTrace(self, request_id, arrival_time * 1e6 if arrival_time else _now_us())


class FrontendRequestTrace:
    """Spans of one request in the API server: ``detokenize`` and ``stream`` inside ``request``."""

    def __init__(self, tracer: FrontendTracer, request_id: str, start_us: float):
        self.tracer = tracer
        self.request_id = request_id
        self.start_us = start_us
        self.events: list[tuple[str, float, float, dict[str, Any] | None]] = []
        self.num_tokens = 0
        self._closed = False

    def span(self, name: str, start_us: float, end_us: float, **args: Any) -> None:
        self.events.append((name, start_us, end_us, args or None))  # formatted by the writer

    now_us = staticmethod(_now_us)

    def close(self, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        if self._closed:
            return
        self._closed = True
        meta = {"finish_reason": finish_reason, "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens, "tokens_streamed": self.num_tokens}
        events = [("request", self.start_us, _now_us(), meta), *self.events]

        def build() -> list[str]:
            return [_span(name, FRONTEND_TID, start, end, json.dumps(args) if args else "")
                    for name, start, end, args in events]

        self.tracer.writer.submit("frontend", self.request_id, build,
                                  {"frontend": meta, "expect_engine": self.tracer.expect_engine_part})


def check_trace(document: dict) -> list[dict]:
    """Validate a Chrome-trace document as this module writes it; returns its complete spans.
    Raises ``ValueError`` naming the first problem (used by tests and ``openinfer.tools.trace``)."""
    events = document.get("traceEvents")
    if not isinstance(events, list):
        raise ValueError("a Chrome trace needs a 'traceEvents' list")
    spans = []
    for event in events:
        if not isinstance(event, dict) or "ph" not in event or "name" not in event:
            raise ValueError(f"malformed trace event {event!r}")
        if event["ph"] == "X":
            if not all(isinstance(event.get(k), (int, float)) for k in ("ts", "dur")) or event["dur"] < 0:
                raise ValueError(f"span {event['name']!r} needs numeric ts and dur >= 0")
            spans.append(event)
    by_track: dict[tuple, list[dict]] = {}
    for span in spans:
        by_track.setdefault((span["pid"], span["tid"]), []).append(span)
    for track, track_spans in by_track.items():
        # sort by start, longer first: a parent precedes its children
        stack: list[dict] = []
        for span in sorted(track_spans, key=lambda s: (s["ts"], -s["dur"])):
            end = span["ts"] + span["dur"]
            while stack and span["ts"] >= stack[-1]["ts"] + stack[-1]["dur"] - 1e-3:
                stack.pop()
            if stack and end > stack[-1]["ts"] + stack[-1]["dur"] + 1e-3:
                raise ValueError(f"span {span['name']!r} at {span['ts']} overlaps {stack[-1]['name']!r} "
                                 f"on track {track} without nesting in it")
            stack.append(span)
    return spans
