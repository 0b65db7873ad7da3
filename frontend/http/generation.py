"""One engine request seen as text: ``ChoiceStream`` turns TokenEvents into ``ChoiceDelta``s.

A choice is started (its first event awaited) before any HTTP response is sent, so a refused
request (``InvalidRequestError``, ``QueueFullError``) becomes a proper 4xx/503 instead of a
broken stream. Invariants:

* the concatenated ``text`` of a choice's deltas is the same whether streamed or not
  (non-streamed responses are built from the very same deltas);
* no delta ends inside a multi-byte character and none contains (part of) a matched stop string;
* ``close()`` always leaves the engine with nothing running for this choice: it closes the
  engine's iterator and, when no ``finished`` event was seen, aborts the request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import anyio
import numpy as np

from openinfer.engine import EngineHandle, finish_reason_name
from openinfer.errors import EngineDeadError, InvalidRequestError, QueueFullError
from openinfer.frontend.http.errors import OpenAIError
from openinfer.frontend.http.metrics import FrontendMetrics
from openinfer.tokenizer import DETOKENIZER_CONTEXT_TOKENS, StopStringMatcher, Tokenizer
from openinfer.tracing import FrontendTracer
from openinfer.v1 import engine_pb2 as pb

# Engine error codes as HTTP statuses.
ENGINE_ERROR_STATUS = {
    pb.ERROR_CODE_INVALID_ARGUMENT: 400,
    pb.ERROR_CODE_RESOURCE_EXHAUSTED: 503,
    pb.ERROR_CODE_UNAVAILABLE: 503,
}


def engine_error(error: pb.TokenEvent.Error) -> OpenAIError:
    status = ENGINE_ERROR_STATUS.get(error.code, 500)
    return OpenAIError(status, f"the engine failed the request: {error.message}", None,
                       pb.ErrorCode.Name(error.code).lower())


@dataclass
class ChoiceDelta:
    """New output of one choice: text plus the ids (and logprobs) that produced it."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[pb.TokenLogprob] | None = None
    finish_reason: str | None = None


@dataclass
class ChoiceUsage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class ChoicePlan:
    """Everything one choice needs besides the engine: its request, its prompt and the text-side
    options. ``prompt_ids`` (int32, read-only) travels beside ``request``, whose own
    ``prompt_token_ids`` stay empty until ``submit`` hands both to the engine."""

    index: int
    request: pb.GenerateRequest
    prompt_ids: np.ndarray
    stop_strings: Sequence[str] = ()
    skip_special_tokens: bool = True


class PromptArrayEngine(Protocol):
    """An ``EngineHandle`` that also takes a request's prompt as one int32 array beside it (the
    request's ``prompt_token_ids`` empty): the engine-core client sends it to the core as one
    buffer, the in-process engine reads it as it is (no protobuf field of 16k varints, no list)."""

    def generate_prompt_array(self, request: pb.GenerateRequest, prompt_ids: np.ndarray
                              ) -> AsyncIterator[pb.TokenEvent]: ...


def submit(engine: EngineHandle, request: pb.GenerateRequest, prompt_ids: np.ndarray
           ) -> AsyncIterator[pb.TokenEvent]:
    """``engine.generate`` of ``request`` with ``prompt_ids`` as its prompt: beside it where the
    engine takes arrays (``PromptArrayEngine``), else written into its ``prompt_token_ids``."""
    generate_prompt_array = getattr(engine, "generate_prompt_array", None)
    if generate_prompt_array is not None:
        return generate_prompt_array(request, prompt_ids)
    if len(request.prompt_token_ids) != len(prompt_ids):
        del request.prompt_token_ids[:]
        request.prompt_token_ids.extend(prompt_ids.tolist())
    return engine.generate(request)


class ChoiceStream:
    def __init__(self, engine: EngineHandle, tokenizer: Tokenizer, plan: ChoicePlan,
                 metrics: FrontendMetrics | None, eos_token_ids: Sequence[int],
                 tracer: FrontendTracer | None = None):
        self.engine = engine
        self.plan = plan
        self.metrics = metrics
        request = plan.request
        self.usage = ChoiceUsage(prompt_tokens=len(plan.prompt_ids))
        self.detokenizer = tokenizer.detokenizer(plan.prompt_ids[-DETOKENIZER_CONTEXT_TOKENS:].tolist(),
                                                 plan.skip_special_tokens)
        self.stop_matcher = StopStringMatcher(plan.stop_strings)
        terminal = set(request.stop.stop_token_ids)
        if not request.stop.ignore_eos:
            terminal.update(eos_token_ids)
        self.terminal_ids = frozenset(terminal)
        self.finished = False
        self._events: AsyncIterator[pb.TokenEvent] | None = None
        self._first: pb.TokenEvent | None = None
        self._last_token_time: float | None = None
        self._recorded = False
        self._finish_reason: str | None = None
        self.trace = tracer.open(request.request_id, request.arrival_time) if tracer is not None else None

    async def start(self) -> ChoiceStream:
        """Submit the request and wait for its first event; refusals raise here."""
        self._events = aiter(submit(self.engine, self.plan.request, self.plan.prompt_ids))
        try:
            self._first = await anext(self._events)
        except (InvalidRequestError, QueueFullError, EngineDeadError):
            self.trace = None  # refused before the engine saw it: nothing to trace
            self.finished = self._recorded = True  # refused: nothing runs in the engine, nothing to count
            raise
        except StopAsyncIteration as exc:
            raise OpenAIError(500, "the engine ended the request without any event", None,
                              "engine_error") from exc
        if self._first.HasField("error"):  # refused at once: answer with a status, not a broken stream
            self.finished = True
            raise engine_error(self._first.error)
        return self

    async def _all_events(self) -> AsyncIterator[pb.TokenEvent]:
        assert self._events is not None and self._first is not None, "start() first"
        yield self._first
        async for event in self._events:
            yield event

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        async for event in self._all_events():
            kind = event.WhichOneof("event")
            if kind == "scheduled":
                self.usage.cached_tokens = event.scheduled.cached_tokens
            elif kind == "tokens":
                delta = self._on_tokens(event.tokens)
                if delta.finish_reason is not None:
                    began = self._trace_now()
                    yield delta
                    self._trace_stream(began)
                    await self.close()
                    return
                if delta.text or delta.token_ids or delta.prompt_logprobs:
                    began = self._trace_now()
                    yield delta
                    self._trace_stream(began)
            elif kind == "finished":
                delta = self._on_finished(event.finished)
                began = self._trace_now()
                yield delta
                self._trace_stream(began)
                return
            elif kind == "error":
                self.finished = True
                self._record_finish("error")
                raise engine_error(event.error)

    def _trace_now(self) -> float:
        return self.trace.now_us() if self.trace is not None else 0.0

    def _trace_stream(self, began: float) -> None:
        """The consumer held the delta from ``began`` to now: SSE encoding and the socket write."""
        if self.trace is not None:
            self.trace.span("stream", began, self.trace.now_us())

    def _on_tokens(self, tokens: pb.TokenEvent.Tokens) -> ChoiceDelta:
        began = self._trace_now()
        now = time.time()
        if self.metrics is not None:
            self.metrics.observe_tokens(self.plan.request.arrival_time, self._last_token_time, now,
                                        len(tokens.ids))
        self._last_token_time = now
        delta = ChoiceDelta(self.plan.index, token_ids=list(tokens.ids), logprobs=list(tokens.logprobs))
        if tokens.prompt_logprobs:
            delta.prompt_logprobs = list(tokens.prompt_logprobs)
        min_tokens = self.plan.request.stop.min_tokens
        text_ids = []
        for token_id in tokens.ids:
            self.usage.completion_tokens += 1
            if token_id in self.terminal_ids and self.usage.completion_tokens > min_tokens:
                break  # the engine stops on this token; its text is not part of the output
            text_ids.append(token_id)
        text, stopped = self.stop_matcher.push(self.detokenizer.push(text_ids))
        delta.text = text
        if stopped:
            delta.finish_reason = "stop"
            self._record_finish("stop")
        if self.trace is not None:
            self.trace.num_tokens += len(tokens.ids)
            self.trace.span("detokenize", began, self.trace.now_us(), tokens=len(tokens.ids))
        return delta

    def _on_finished(self, finished: pb.TokenEvent.Finished) -> ChoiceDelta:
        self.finished = True
        text, stopped = self.stop_matcher.push(self.detokenizer.flush())
        if not stopped:
            text += self.stop_matcher.flush()
        reason = "stop" if stopped else finish_reason_name(finished.reason)
        if finished.prompt_tokens:
            self.usage.prompt_tokens = finished.prompt_tokens
        self.usage.completion_tokens = max(self.usage.completion_tokens, finished.completion_tokens)
        self.usage.cached_tokens = max(self.usage.cached_tokens, finished.cached_tokens)
        self._record_finish(reason)
        return ChoiceDelta(self.plan.index, text=text, finish_reason=reason)

    def _record_finish(self, reason: str) -> None:
        """Count the request once, under the first reason it ended with."""
        if self._recorded:
            return
        self._recorded = True
        self._finish_reason = reason
        if self.metrics is not None:
            self.metrics.observe_finish(reason, self.usage.prompt_tokens, self.usage.completion_tokens)

    async def close(self) -> None:
        """Close the engine iterator; abort the request if it has not finished. Idempotent."""
        events, self._events = self._events, None
        if events is None:
            return
        trace, self.trace = self.trace, None
        with anyio.CancelScope(shield=True):
            closer = getattr(events, "aclose", None)
            if closer is not None:
                await closer()
            if not self.finished:
                self.finished = True
                self._record_finish("abort")
                await self.engine.abort(self.plan.request.request_id)
            if trace is not None:
                trace.close(self._finish_reason or "abort", self.usage.prompt_tokens, self.usage.completion_tokens)


async def start_within(stream: ChoiceStream, max_queue_wait_s: float | None) -> ChoiceStream:
    """``stream.start()``, given up after ``max_queue_wait_s``: the engine's first event comes when
    it schedules the request, so this bounds the time spent waiting in its queue."""
    if not max_queue_wait_s:
        return await stream.start()
    # a cancel scope in this task, not wait_for's task per request: one event-loop hop less
    with anyio.move_on_after(max_queue_wait_s):
        return await stream.start()
    raise OpenAIError(503, f"the request waited {max_queue_wait_s:g}s in the engine's queue without being "
                           "scheduled (the server is overloaded); retry later", None, "queue_timeout",
                      {"Retry-After": str(max(1, round(max_queue_wait_s / 4)))})


async def start_choices(engine: EngineHandle, tokenizer: Tokenizer, plans: Sequence[ChoicePlan],
                        metrics: FrontendMetrics | None, max_queue_wait_s: float | None = None,
                        tracer: FrontendTracer | None = None) -> list[ChoiceStream]:
    """Start every choice concurrently, or none: if one is refused (or waits in the queue longer
    than ``max_queue_wait_s``), all are closed (aborted) and the first refusal is raised."""
    eos = list(engine.info().eos_token_ids) or tokenizer.eos_token_ids
    streams = [ChoiceStream(engine, tokenizer, plan, metrics, eos, tracer) for plan in plans]
    try:
        if len(streams) == 1:  # (n = 1, one prompt) awaited in this task: no task to start and join
            try:
                outcomes: list = [await start_within(streams[0], max_queue_wait_s)]
            except Exception as exc:  # a refusal: raised below as gather's would be
                outcomes = [exc]
        else:
            outcomes = await asyncio.gather(*(start_within(s, max_queue_wait_s) for s in streams),
                                            return_exceptions=True)
    except BaseException:  # cancelled while starting (client gone, shutdown)
        await close_all(streams)
        raise
    failures = [o for o in outcomes if isinstance(o, BaseException)]
    if failures:
        await close_all(streams)
        raise failures[0]
    return streams


async def close_all(streams: Sequence[ChoiceStream]) -> None:
    for stream in streams:
        await stream.close()


async def collect(stream: ChoiceStream) -> list[ChoiceDelta]:
    try:
        return [delta async for delta in stream.deltas()]
    finally:
        await stream.close()


async def collect_all(streams: Sequence[ChoiceStream]) -> list[list[ChoiceDelta]]:
    """Run every choice to the end concurrently; deltas per choice, in choice order."""
    try:
        return list(await asyncio.gather(*(collect(s) for s in streams)))
    finally:
        await close_all(streams)


async def merge_deltas(streams: Sequence[ChoiceStream]) -> AsyncIterator[ChoiceDelta]:
    """Interleave the deltas of all choices as they come. Closing this generator (client gone)
    cancels every choice and aborts their engine requests. One choice (the usual n=1) is
    iterated directly: no task, no queue hop per delta."""
    if len(streams) == 1:
        try:
            async for delta in streams[0].deltas():
                yield delta
        finally:
            with anyio.CancelScope(shield=True):
                await close_all(streams)
        return
    queue: asyncio.Queue[ChoiceDelta | BaseException | None] = asyncio.Queue()

    async def pump(stream: ChoiceStream) -> None:
        try:
            async for delta in stream.deltas():
                await queue.put(delta)
            await queue.put(None)
        except Exception as exc:  # handed to the consumer, which re-raises it
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        with anyio.CancelScope(shield=True):
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await close_all(streams)
