"""What the SGLang-scheduler and vLLM-engine worker services share; each protocol keeps only its conversion.

Both turn one router request into a plan of engine requests (one per choice), run them as one
merged response stream, end a choice early at a stop string, map engine failures to gRPC
statuses and abort by router request id. :class:`WorkerServicer` does that; a protocol's
servicer supplies ``_plan`` (router request → plan) and ``_generate_choice`` (engine events →
its responses), built from the helpers here.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from smg_grpc_proto.generated import common_pb2

from openinfer.engine import EngineHandle
from openinfer.errors import EngineDeadError, InvalidRequestError, QueueFullError
from openinfer.frontend.grpc.sglang_fanout import merge_streams
from openinfer.frontend.grpc.sglang_load import RecentRates
from openinfer.frontend.grpc.sglang_stop import StopStringWatcher
from openinfer.frontend.grpc.sglang_tokenizer_bundle import build_tokenizer_zip, iter_bundle_chunks
from openinfer.frontend.validation import check_generate_request
from openinfer.tokenizer import Tokenizer
from openinfer.v1 import engine_pb2 as pb

logger = logging.getLogger(__name__)

FINISH_REASONS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
}
_ENGINE_ERROR_STATUS = {
    pb.ERROR_CODE_INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    pb.ERROR_CODE_RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    pb.ERROR_CODE_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    pb.ERROR_CODE_INTERNAL: grpc.StatusCode.INTERNAL,
}


class RequestPlan(Protocol):
    """What both protocols' plans have: choice ``i`` is ``engine_requests[i]``."""

    @property
    def request_id(self) -> str: ...
    @property
    def engine_requests(self) -> tuple[pb.GenerateRequest, ...]: ...
    @property
    def stream(self) -> bool: ...
    @property
    def stop_strings(self) -> tuple[str, ...]: ...
    @property
    def skip_special_tokens(self) -> bool: ...


class ChoiceOf:
    """Mixin for a per-choice response builder with fields ``plan`` and ``index``."""

    plan: Any
    index: int

    @property
    def engine_request(self) -> pb.GenerateRequest:
        return self.plan.engine_requests[self.index]

    @property
    def prompt_tokens(self) -> int:
        return len(self.engine_request.prompt_token_ids)


@dataclass
class TokenStep:
    """New ids of one choice (cut at a completed stop string), their logprobs, the stop string matched."""

    ids: list[int]
    logprobs: Sequence[pb.TokenLogprob]
    matched_stop_str: str | None


class EngineFailure(Exception):
    """A request the engine refused or failed, as the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    @classmethod
    def from_event(cls, error: pb.TokenEvent.Error) -> EngineFailure:
        return cls(_ENGINE_ERROR_STATUS.get(error.code, grpc.StatusCode.INTERNAL), error.message)

    @classmethod
    def no_finished_event(cls, request_id: str) -> EngineFailure:
        return cls(grpc.StatusCode.INTERNAL, f"the engine ended request {request_id!r} without a finished "
                   "event; see the worker's log")


def check_finished(finished: pb.TokenEvent.Finished, request_id: str) -> None:
    """Raises :class:`EngineFailure` when the engine finished the request with an error."""
    if finished.reason == pb.FINISH_REASON_ERROR:
        raise EngineFailure(grpc.StatusCode.INTERNAL,
                            f"the engine failed request {request_id!r}; see the worker's log")


@contextlib.contextmanager
def engine_errors() -> Iterator[None]:
    """The engine's refusals (raised by ``EngineHandle.generate``) as :class:`EngineFailure`."""
    try:
        yield
    except InvalidRequestError as exc:
        raise EngineFailure(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
    except QueueFullError as exc:
        raise EngineFailure(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from exc
    except EngineDeadError as exc:
        raise EngineFailure(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc


def kept_ids(watcher: StopStringWatcher | None, ids: Sequence[int]) -> tuple[list[int], str | None]:
    """The ids to send (up to a completed stop string) and the stop string that matched, if any."""
    return watcher.push(ids) if watcher is not None else (list(ids), None)


class WorkerServicer(abc.ABC):
    """The protocol-independent half of a worker service for one engine. Put it first in the
    bases (before the generated servicer) so its ``Generate``/``GetTokenizer`` are the ones served."""

    def __init__(self, engine: EngineHandle, *, served_model_name: str, model_path: str, tokenizer_path: str):
        self._engine = engine
        self._served_model_name = served_model_name
        self._model_path = os.path.abspath(model_path)
        self._tokenizer_path = os.path.abspath(tokenizer_path or model_path)
        self._started = time.time()
        self._active: dict[str, list[str]] = {}  # router request id → its engine request ids
        self._last_receive = 0.0
        self._rates = RecentRates()
        self._tokenizer: Tokenizer | None = None
        self._tokenizer_error: str | None = None
        self._tokenizer_lock = asyncio.Lock()
        self._tokenizer_zip: bytes | None = None

    @abc.abstractmethod
    def _plan(self, request: Any, info: pb.ModelInfo, arrival_time: float) -> Any:
        """The router's request as engine requests (raises ``InvalidRequestError``)."""

    @abc.abstractmethod
    def _generate_choice(self, plan: Any, index: int) -> AsyncIterator[Any]:
        """Choice ``index``'s engine events as the protocol's responses (raises :class:`EngineFailure`)."""

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        self._last_receive = time.time()
        try:
            info = self._engine.info()
            plan = self._plan(request, info, self._last_receive)
            for choice in plan.engine_requests:
                check_generate_request(choice, info)  # the same limits as openinfer's HTTP server
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self._active[plan.request_id] = [choice.request_id for choice in plan.engine_requests]
        choices = [self._generate_choice(plan, index) for index in range(len(plan.engine_requests))]
        stream = choices[0] if len(choices) == 1 else merge_streams(choices)
        try:
            async with contextlib.aclosing(stream) as responses:
                async for response in responses:
                    yield response
        except EngineFailure as failure:
            await context.abort(failure.code, failure.message)
        finally:
            self._active.pop(plan.request_id, None)

    async def _choice_steps(self, builder: Any) -> AsyncIterator[TokenStep | pb.TokenEvent.Finished]:
        """One choice's engine events as :class:`TokenStep`s, then its (successful) ``Finished``;
        ``builder`` (a :class:`ChoiceOf` with ``cached_tokens``, ``input_logprobs`` and
        ``add_prompt_logprobs``) gets the cache hits and prompt logprobs. Closing this early (a stop
        string, the router going away) closes the engine's iterator, which aborts the request and
        frees its KV blocks. Engine refusals and failures raise :class:`EngineFailure`."""
        watcher = await self._stop_watcher(builder.plan, builder.engine_request)
        with engine_errors():
            async with contextlib.aclosing(self._engine.generate(builder.engine_request)) as events:
                async for event in events:
                    kind = event.WhichOneof("event")
                    if kind == "scheduled":
                        builder.cached_tokens = event.scheduled.cached_tokens
                    elif kind == "tokens":
                        if event.tokens.prompt_logprobs and builder.input_logprobs is None:
                            builder.add_prompt_logprobs(event.tokens.prompt_logprobs)
                        ids, matched = kept_ids(watcher, event.tokens.ids)
                        self._rates.record_tokens(len(ids))
                        yield TokenStep(ids, event.tokens.logprobs, matched)
                    elif kind == "finished":
                        check_finished(event.finished, builder.engine_request.request_id)
                        builder.cached_tokens = max(builder.cached_tokens, event.finished.cached_tokens)
                        self._rates.record_prompt(builder.prompt_tokens, builder.cached_tokens)
                        yield event.finished
                        return
                    elif kind == "error":
                        raise EngineFailure.from_event(event.error)
        raise EngineFailure.no_finished_event(builder.engine_request.request_id)

    async def _stop_watcher(self, plan: RequestPlan, choice: pb.GenerateRequest) -> StopStringWatcher | None:
        if not plan.stop_strings:
            return None
        tokenizer = await self._load_tokenizer()
        if tokenizer is None:
            return None  # the router still trims the text; the engine just runs to its limit
        return StopStringWatcher(tokenizer, choice.prompt_token_ids, plan.stop_strings, plan.skip_special_tokens,
                                 choice.stop.min_tokens)

    async def _load_tokenizer(self) -> Tokenizer | None:
        """The tokenizer, loaded once (off the event loop) when the first stop string arrives."""
        async with self._tokenizer_lock:
            if self._tokenizer is None and self._tokenizer_error is None:
                try:
                    self._tokenizer = await asyncio.to_thread(Tokenizer.from_dir, self._tokenizer_path)
                except (OSError, ValueError) as exc:
                    self._tokenizer_error = str(exc)
                    logger.warning("stop strings are left to the router (the worker cannot load the "
                                   "tokenizer from %s: %s)", self._tokenizer_path, exc)
        return self._tokenizer

    async def _abort(self, request_id: str) -> bool:
        """Aborts every engine request of a router request; whether the engine knew any of them."""
        found = False
        for engine_request_id in self._active.get(request_id, [request_id]):
            found = await self._engine.abort(engine_request_id) or found
        return found

    def _health_message(self) -> tuple[bool, str]:
        health = self._engine.health()
        return health.healthy, health.message or ("healthy" if health.healthy else "the engine is not healthy")

    async def GetTokenizer(self, request: common_pb2.GetTokenizerRequest,
                           context: grpc.aio.ServicerContext) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        if self._tokenizer_zip is None:
            try:
                self._tokenizer_zip = await asyncio.to_thread(build_tokenizer_zip, self._tokenizer_path)
            except FileNotFoundError as exc:
                await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        for data, digest in iter_bundle_chunks(self._tokenizer_zip):
            yield common_pb2.GetTokenizerChunk(data=data, sha256=digest)
