"""``sglang.grpc.scheduler.SglangScheduler`` over any ``EngineHandle``: what the ``smg`` router drives.

The router (PyPI ``smg``) tokenizes, applies the chat template, detokenizes and trims stop
strings itself; a worker only turns token ids into token ids. This servicer maps that protocol
(from PyPI ``smg-grpc-proto``) onto openinfer's contract and nothing else: it never imports a
model plugin, only ``EngineHandle`` and ``openinfer.tokenizer`` (for stop strings).

    smg launch --worker-urls grpc://HOST:PORT   ──Generate/Abort/GetLoads/...──▶  this servicer
                                                                                    │ EngineHandle
                                                                                    ▼
                                                                                  engine

Register it with :func:`add_sglang_service` on the same ``grpc.aio`` server (and port) as
``openinfer.v1.Engine``; build that server with :data:`SGLANG_SERVER_OPTIONS`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from importlib.metadata import PackageNotFoundError, version

import grpc
from google.protobuf.struct_pb2 import Struct
from google.protobuf.timestamp_pb2 import Timestamp
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sglang_pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sglang_grpc

from openinfer.engine import EngineHandle
from openinfer.errors import EngineDeadError, InvalidRequestError, QueueFullError
from openinfer.frontend.grpc.malformed import add_servicer
from openinfer.frontend.grpc.sglang_convert import SglangRequestPlan, to_engine_requests
from openinfer.frontend.grpc.sglang_fanout import merge_streams
from openinfer.frontend.grpc.sglang_load import RecentRates, loads_response
from openinfer.frontend.grpc.sglang_responses import FINISH_REASONS, SglangResponseBuilder
from openinfer.frontend.grpc.sglang_stop import StopStringWatcher
from openinfer.frontend.grpc.sglang_tokenizer_bundle import build_tokenizer_zip, iter_bundle_chunks
from openinfer.frontend.validation import check_generate_request
from openinfer.tokenizer import Tokenizer
from openinfer.v1 import engine_pb2 as pb

logger = logging.getLogger(__name__)

# Server options the router needs: it pings every 30 s, also while idle; gRPC's default
# (no pings without data more often than every 5 min) would answer with GOAWAY.
SGLANG_SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]

_ENGINE_ERROR_STATUS = {
    pb.ERROR_CODE_INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    pb.ERROR_CODE_RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    pb.ERROR_CODE_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    pb.ERROR_CODE_INTERNAL: grpc.StatusCode.INTERNAL,
}


def _openinfer_version() -> str:
    try:
        return version("openinfer")
    except PackageNotFoundError:
        return "unknown"


def _struct(values: dict[str, object]) -> Struct:
    result = Struct()
    result.update(values)
    return result


class SglangSchedulerServicer(sglang_grpc.SglangSchedulerServicer):
    """The SGLang scheduler service for one engine (one data-parallel rank, no LoRA, text only).
    A request with ``n`` > 1 runs as ``n`` engine requests (``{request_id}-{i}``), interleaved.

    RPCs not overridden here (profiling, LoRA, KV-event subscription, flush) answer
    UNIMPLEMENTED; the router falls back to polling ``GetLoads``.
    """

    def __init__(self, engine: EngineHandle, *, served_model_name: str, model_path: str,
                 tokenizer_path: str):
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

    # --- generation -----------------------------------------------------------------------------

    async def Generate(self, request: sglang_pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[sglang_pb.GenerateResponse]:
        self._last_receive = time.time()
        try:
            info = self._engine.info()
            plan = to_engine_requests(request, info, arrival_time=self._last_receive)
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
        except _EngineFailure as failure:
            await context.abort(failure.code, failure.message)
        finally:
            self._active.pop(plan.request_id, None)

    async def _generate_choice(self, plan: SglangRequestPlan,
                               index: int) -> AsyncIterator[sglang_pb.GenerateResponse]:
        """One choice's engine events → SGLang responses. Leaving early (a stop string, the router
        going away) closes the engine's iterator, which aborts the request and frees its KV blocks."""
        builder = SglangResponseBuilder(plan, index)
        watcher = await self._stop_watcher(plan, builder.engine_request)
        try:
            async with contextlib.aclosing(self._engine.generate(builder.engine_request)) as events:
                async for event in events:
                    kind = event.WhichOneof("event")
                    if kind == "scheduled":
                        builder.cached_tokens = event.scheduled.cached_tokens
                    elif kind == "tokens":
                        if event.tokens.prompt_logprobs and builder.input_logprobs is None:
                            builder.add_prompt_logprobs(event.tokens.prompt_logprobs)
                        ids, matched = (watcher.push(event.tokens.ids) if watcher is not None
                                        else (list(event.tokens.ids), None))
                        chunk = builder.add_tokens(ids, event.tokens.logprobs)
                        self._rates.record_tokens(len(ids))
                        if plan.stream and ids:
                            yield chunk
                        if matched is not None:
                            yield builder.complete("stop", matched_stop_str=matched)
                            return
                    elif kind == "finished":
                        complete = self._complete(builder, event.finished)
                        self._rates.record_prompt(builder.prompt_tokens, builder.cached_tokens)
                        yield complete
                        return
                    elif kind == "error":
                        raise _EngineFailure(_ENGINE_ERROR_STATUS.get(event.error.code, grpc.StatusCode.INTERNAL),
                                             event.error.message)
        except InvalidRequestError as exc:
            raise _EngineFailure(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        except QueueFullError as exc:
            raise _EngineFailure(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from exc
        except EngineDeadError as exc:
            raise _EngineFailure(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc
        raise _EngineFailure(grpc.StatusCode.INTERNAL,
                             f"the engine ended request {builder.engine_request.request_id!r} without a "
                             "finished event; see the worker's log")

    @staticmethod
    def _complete(builder: SglangResponseBuilder, finished: pb.TokenEvent.Finished) -> sglang_pb.GenerateResponse:
        if finished.reason == pb.FINISH_REASON_ERROR:
            raise _EngineFailure(grpc.StatusCode.INTERNAL,
                                 f"the engine failed request {builder.engine_request.request_id!r}; see the "
                                 "worker's log")
        builder.cached_tokens = max(builder.cached_tokens, finished.cached_tokens)
        matched = (finished.matched_stop_token_id
                   if finished.HasField("matched_stop_token_id") and finished.reason == pb.FINISH_REASON_STOP
                   else None)
        return builder.complete(FINISH_REASONS.get(finished.reason, "stop"), matched_token_id=matched)

    async def _stop_watcher(self, plan: SglangRequestPlan, choice: pb.GenerateRequest) -> StopStringWatcher | None:
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

    async def Abort(self, request: sglang_pb.AbortRequest,
                    context: grpc.aio.ServicerContext) -> sglang_pb.AbortResponse:
        found = False
        for engine_request_id in self._active.get(request.request_id, [request.request_id]):
            found = await self._engine.abort(engine_request_id) or found
        message = "aborted" if found else "not found (already finished or never started)"
        return sglang_pb.AbortResponse(success=found, message=f"request {request.request_id!r} {message}")

    async def Embed(self, request: sglang_pb.EmbedRequest,
                    context: grpc.aio.ServicerContext) -> sglang_pb.EmbedResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            f"{self._served_model_name} is served as a generation model; openinfer has "
                            "no embedding endpoint")

    # --- health, model, server, load ------------------------------------------------------------

    async def HealthCheck(self, request: sglang_pb.HealthCheckRequest,
                          context: grpc.aio.ServicerContext) -> sglang_pb.HealthCheckResponse:
        health = self._engine.health()
        message = health.message or ("healthy" if health.healthy else "the engine is not healthy")
        return sglang_pb.HealthCheckResponse(healthy=health.healthy, message=message)

    async def GetModelInfo(self, request: sglang_pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> sglang_pb.GetModelInfoResponse:
        info = self._engine.info()
        response = sglang_pb.GetModelInfoResponse(
            model_path=self._model_path,
            tokenizer_path=self._tokenizer_path,
            is_generation=True,
            weight_version="default",
            served_model_name=self._served_model_name,
            max_context_length=info.max_model_len,
            vocab_size=info.vocab_size,
            supports_vision=False,
            model_type=info.model_type,
            eos_token_ids=list(info.eos_token_ids),
            max_req_input_len=max(info.max_model_len - 1, 0),
            architectures=list(info.architectures),
        )
        if info.HasField("bos_token_id"):
            response.bos_token_id = info.bos_token_id
        return response

    async def GetServerInfo(self, request: sglang_pb.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> sglang_pb.GetServerInfoResponse:
        info = self._engine.info()
        max_total_tokens = info.kv_block_size * info.num_kv_blocks
        server_args = {
            "model_path": self._model_path,
            "tokenizer_path": self._tokenizer_path,
            "served_model_name": self._served_model_name,
            "context_length": info.max_model_len,
            "max_total_tokens": max_total_tokens,
            "vocab_size": info.vocab_size,
            "tp_size": info.tensor_parallel_size or 1,
            "dp_size": 1,
            "is_embedding": False,
            "backend": info.backend,
            "plugin": info.plugin,
            "kv_block_size": info.kv_block_size,
        }
        start_time = Timestamp()
        start_time.FromSeconds(int(self._started))
        return sglang_pb.GetServerInfoResponse(
            server_args=_struct(server_args),
            scheduler_info=_struct({"max_total_num_tokens": max_total_tokens,
                                    "max_req_input_len": max(info.max_model_len - 1, 0)}),
            active_requests=len(self._active),
            is_paused=False,
            last_receive_timestamp=self._last_receive,
            uptime_seconds=time.time() - self._started,
            sglang_version=f"openinfer {_openinfer_version()}",
            server_type="grpc",
            start_time=start_time,
            max_total_num_tokens=max_total_tokens,
        )

    async def GetLoads(self, request: sglang_pb.GetLoadsRequest,
                       context: grpc.aio.ServicerContext) -> sglang_pb.GetLoadsResponse:
        return loads_response(self._engine.info(), self._engine.load(), self._rates, include=request.include,
                              dp_rank=request.dp_rank if request.HasField("dp_rank") else None,
                              version=f"openinfer {_openinfer_version()}")

    async def GetTokenizer(self, request: common_pb2.GetTokenizerRequest,
                           context: grpc.aio.ServicerContext) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        if self._tokenizer_zip is None:
            try:
                self._tokenizer_zip = await asyncio.to_thread(build_tokenizer_zip, self._tokenizer_path)
            except FileNotFoundError as exc:
                await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        for data, digest in iter_bundle_chunks(self._tokenizer_zip):
            yield common_pb2.GetTokenizerChunk(data=data, sha256=digest)


class _EngineFailure(Exception):
    """A request the engine refused or failed, as the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def add_sglang_service(server: grpc.aio.Server, engine: EngineHandle, *, served_model_name: str,
                       model_path: str, tokenizer_path: str) -> None:
    """Serve ``sglang.grpc.scheduler.SglangScheduler`` for ``engine`` on ``server`` (same port as
    ``openinfer.v1.Engine``). Paths are made absolute: the router loads the tokenizer from
    ``tokenizer_path`` when it shares the file system, else it asks ``GetTokenizer``."""
    servicer = SglangSchedulerServicer(engine, served_model_name=served_model_name,
                                       model_path=model_path, tokenizer_path=tokenizer_path)
    add_servicer(sglang_grpc.add_SglangSchedulerServicer_to_server, servicer, server)
