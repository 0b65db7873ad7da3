"""Per-step output entries and the per-request slot they merge into.

An engine step produces a list of entries ``(request_id, kind, payload)`` — every request's new
token, scheduling note, finish or error of that step. The list crosses a thread (in-process
engine: one ``call_soon_threadsafe`` per step) or a process (engine core: one message per step)
as a whole; on the receiving event loop each entry is pushed into its request's ``RequestSlot``.
A slot *merges*: tokens that arrive while the consumer is busy are handed over as one
``Tokens`` event with several ids, so a slow consumer costs one wake-up per read, not a queue
item per token.

Entry payloads (plain Python values, so msgspec encodes them without a schema):

* ``TOKEN``: the token id (int)
* ``TOKENS_PB``: a ``TokenEvent.Tokens`` (in process) or its serialized bytes (over the wire) —
  only for tokens carrying logprobs or prompt logprobs
* ``SCHEDULED``: cached prompt tokens (int)
* ``FINISHED``: ``[reason, prompt_tokens, completion_tokens, cached_tokens, matched_stop or -1]``
* ``ERROR``: ``[error_code, message]``
* ``REJECTED``: ``[error_code, message, field or max_queue]`` — refused at admission by an
  engine in another process (a local engine raises instead); ends the request like ERROR
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Iterator
from typing import Any

from openinfer.v1 import engine_pb2 as pb

TOKEN, TOKENS_PB, SCHEDULED, FINISHED, ERROR, REJECTED = range(6)
TERMINAL_KINDS = (FINISHED, ERROR, REJECTED)


def finished_payload(finished: pb.TokenEvent.Finished) -> list[int]:
    matched = finished.matched_stop_token_id if finished.HasField("matched_stop_token_id") else -1
    return [finished.reason, finished.prompt_tokens, finished.completion_tokens, finished.cached_tokens, matched]


def error_event(request_id: str, code: int, message: str) -> pb.TokenEvent:
    return pb.TokenEvent(request_id=request_id, error=pb.TokenEvent.Error(code=code, message=message))


class RequestSlot:
    """The not-yet-consumed output of one request, owned by one event loop."""

    __slots__ = ("request_id", "loop", "cached", "ids", "logprobs", "prompt_logprobs", "terminal", "rejection",
                 "_waiter")

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.loop = loop
        self.cached: int | None = None
        self.ids: list[int] = []
        self.logprobs: list[pb.TokenLogprob] = []
        self.prompt_logprobs: list[pb.TokenLogprob] = []
        self.terminal: pb.TokenEvent | None = None
        self.rejection: tuple | None = None
        self._waiter: asyncio.Future | None = None

    @property
    def done(self) -> bool:
        return self.terminal is not None

    def push(self, kind: int, payload: Any) -> None:
        """Merge one entry (on the slot's loop). Anything after the terminal event is dropped."""
        if self.terminal is not None:
            return
        if kind == TOKEN:
            self.ids.append(payload)
        elif kind == TOKENS_PB:
            tokens = payload
            if isinstance(payload, bytes):
                tokens = pb.TokenEvent.Tokens()
                tokens.ParseFromString(payload)
            self.ids.extend(tokens.ids)
            self.logprobs.extend(tokens.logprobs)
            self.prompt_logprobs.extend(tokens.prompt_logprobs)
        elif kind == SCHEDULED:
            self.cached = payload
        elif kind == FINISHED:
            reason, prompt, completion, cached, matched = payload
            finished = pb.TokenEvent.Finished(reason=reason, prompt_tokens=prompt, completion_tokens=completion,
                                              cached_tokens=cached)
            if matched >= 0:
                finished.matched_stop_token_id = matched
            self.terminal = pb.TokenEvent(request_id=self.request_id, finished=finished)
        elif kind == ERROR:
            code, message = payload
            self.terminal = error_event(self.request_id, code, message)
        elif kind == REJECTED:
            self.rejection = tuple(payload)
            self.terminal = error_event(self.request_id, payload[0], payload[1])
        self._wake()

    def fail(self, code: int, message: str) -> None:
        """End the request with an error unless it already ended (e.g. its engine died)."""
        self.push(ERROR, (code, message))

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _has_output(self) -> bool:
        return self.cached is not None or bool(self.ids) or self.terminal is not None

    async def events(self) -> AsyncIterator[pb.TokenEvent]:
        """The request's events in contract order; returns after the terminal one."""
        while True:
            if not self._has_output():
                self._waiter = self.loop.create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
            if self.cached is not None:
                cached, self.cached = self.cached, None
                yield pb.TokenEvent(request_id=self.request_id, scheduled=pb.TokenEvent.Scheduled(cached_tokens=cached))
            if self.ids:
                tokens = pb.TokenEvent.Tokens(ids=self.ids)
                if self.logprobs:
                    tokens.logprobs.extend(self.logprobs)
                    self.logprobs = []
                if self.prompt_logprobs:
                    tokens.prompt_logprobs.extend(self.prompt_logprobs)
                    self.prompt_logprobs = []
                self.ids = []
                yield pb.TokenEvent(request_id=self.request_id, tokens=tokens)
            if self.terminal is not None and not self.ids and self.cached is None:
                yield self.terminal
                return


def drain(inbox: Any) -> Iterator[tuple[str, Any]]:
    """The ``(command, payload)`` items waiting in an engine's command inbox (a ``queue.Queue`` or
    anything with ``get_nowait()`` raising ``queue.Empty``), without blocking."""
    while True:
        try:
            yield inbox.get_nowait()
        except queue.Empty:
            return


def dispatch(slots: dict[str, RequestSlot], entries: list) -> None:
    """Push a step's entries ``(request_id, kind, payload)`` into their slots (unknown ids — a
    request already ended or closed here — are skipped); terminal entries drop the slot."""
    for request_id, kind, payload in entries:
        slot = slots.get(request_id)
        if slot is None:
            continue
        slot.push(kind, payload)
        if kind in TERMINAL_KINDS:
            del slots[request_id]
