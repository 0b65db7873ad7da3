"""``HandleAdapter``: any ``EngineHandle`` behind the engine-core transport.

``PagedEngine`` speaks the transport natively (per-step outboxes). A plugin may bring its own
engine that only implements the ``EngineHandle`` protocol; this adapter runs it on an asyncio
loop in one thread, turns its ``TokenEvent``s into entries and delivers everything gathered
in one loop turn at once — the same one-message-per-turn shape, just without knowing where
the engine's steps begin and end.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np

from openinfer.engine_core.slots import (
    ERROR,
    FINISHED,
    REJECTED,
    SCHEDULED,
    TOKEN,
    TOKENS_PB,
    drain,
    finished_payload,
)
from openinfer.errors import EngineDeadError, InvalidRequestError, QueueFullError
from openinfer.v1 import engine_pb2 as pb

POLL_S = 0.001


class HandleAdapter:
    def __init__(self, engine: Any):
        self.engine = engine
        self._streams: dict[str, Any] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._outbox: list = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def info(self) -> pb.ModelInfo:
        return self.engine.info()

    def health(self) -> pb.HealthResponse:
        if self._thread is not None and not self._thread.is_alive() and not self._stopping:
            return pb.HealthResponse(healthy=False, message="engine adapter loop exited")
        return self.engine.health()

    def load(self) -> pb.Load:
        return self.engine.load()

    def admit(self, request: pb.GenerateRequest, destination: Any, prompt: np.ndarray | None = None) -> None:
        """``prompt``: the ids that came beside the request (the engine-core protocol's prompt
        buffer): the wrapped handle reads them from the request's ``prompt_token_ids``."""
        if request.request_id in self._streams:
            raise InvalidRequestError(f"request_id {request.request_id!r} is already in flight", "request_id")
        if prompt is not None:
            if len(request.prompt_token_ids):
                raise InvalidRequestError("the prompt came both beside the request and in prompt_token_ids; "
                                          "send it once", "prompt_token_ids")
            if len(prompt) and prompt.min() < 0:
                raise InvalidRequestError(f"prompt token id {int(prompt.min())} is negative", "prompt_token_ids")
            request.prompt_token_ids.extend(prompt.tolist())
        self._streams[request.request_id] = destination
        self._inbox.put(("add", request))

    def requests_of(self, destination: Any) -> list[str]:
        return [rid for rid, dest in self._streams.items() if dest == destination]

    def attach_transport(self, inbox: Any, deliver: Any) -> None:
        self._inbox, self._deliver = inbox, deliver
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="openinfer-adapter",
                                        daemon=True)
        self._thread.start()

    async def _run(self) -> None:
        self._loop = asyncio.get_running_loop()
        while not self._stopping:
            for command, payload in drain(self._inbox):
                if command == "add":
                    self._tasks[payload.request_id] = asyncio.create_task(self._consume(payload))
                elif command == "abort":
                    await self.engine.abort(payload)
                elif command == "reject":
                    self._outbox.append(payload)
                elif command == "stop":
                    self._stopping = True
            if self._outbox:
                entries, self._outbox = self._outbox, []
                self._deliver(entries)
            await asyncio.sleep(POLL_S if self._tasks else 50 * POLL_S)
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        if self._outbox:
            self._deliver(self._outbox)
        await self.engine.close()

    def _emit(self, request_id: str, kind: int, payload: Any, final: bool = False) -> None:
        destination = self._streams.pop(request_id, None) if final else self._streams.get(request_id)
        if destination is not None:
            self._outbox.append((destination, request_id, kind, payload))

    async def _consume(self, request: pb.GenerateRequest) -> None:
        rid = request.request_id
        try:
            async for event in self.engine.generate(request):
                kind = event.WhichOneof("event")
                if kind == "scheduled":
                    self._emit(rid, SCHEDULED, event.scheduled.cached_tokens)
                elif kind == "tokens":
                    tokens = event.tokens
                    if tokens.logprobs or tokens.prompt_logprobs or len(tokens.ids) != 1:
                        self._emit(rid, TOKENS_PB, tokens)
                    else:
                        self._emit(rid, TOKEN, tokens.ids[0])
                elif kind == "finished":
                    self._emit(rid, FINISHED, finished_payload(event.finished), final=True)
                elif kind == "error":
                    self._emit(rid, ERROR, [event.error.code, event.error.message], final=True)
        except InvalidRequestError as exc:
            self._emit(rid, REJECTED, [pb.ERROR_CODE_INVALID_ARGUMENT, str(exc), exc.field or ""], final=True)
        except QueueFullError as exc:
            self._emit(rid, REJECTED, [pb.ERROR_CODE_RESOURCE_EXHAUSTED, str(exc), exc.max_queue], final=True)
        except EngineDeadError as exc:
            self._emit(rid, REJECTED, [pb.ERROR_CODE_UNAVAILABLE, str(exc), ""], final=True)
        except asyncio.CancelledError:
            self._emit(rid, ERROR, [pb.ERROR_CODE_UNAVAILABLE, "engine shut down"], final=True)
        except Exception as exc:
            self._emit(rid, ERROR, [pb.ERROR_CODE_INTERNAL, f"engine failed: {exc!r}"], final=True)
        finally:
            self._tasks.pop(rid, None)
            self._streams.pop(rid, None)

    def close_sync(self) -> None:
        self._inbox.put(("stop", None))
        if self._thread is not None:
            self._thread.join(30)
