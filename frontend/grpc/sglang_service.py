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

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from importlib.metadata import PackageNotFoundError, version

import grpc
from google.protobuf.struct_pb2 import Struct
from google.protobuf.timestamp_pb2 import Timestamp
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sglang_pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sglang_grpc

from openinfer.engine import EngineHandle
from openinfer.frontend.grpc.malformed import add_servicer
from openinfer.frontend.grpc.sglang_convert import SglangRequestPlan, to_engine_requests
from openinfer.frontend.grpc.sglang_load import loads_response
from openinfer.frontend.grpc.sglang_responses import SglangResponseBuilder
from openinfer.frontend.grpc.worker_service import (
    FINISH_REASONS,
    TokenStep,
    WorkerServicer,
)
from openinfer.v1 import engine_pb2 as pb

logger = logging.getLogger(__name__)

# Server options the router needs: it pings every 30 s, also while idle; gRPC's default
# (no pings without data more often than every 5 min) would answer with GOAWAY.
SGLANG_SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]

def _openinfer_version() -> str:
    try:
        return version("openinfer")
    except PackageNotFoundError:
        return "unknown"


def _struct(values: dict[str, object]) -> Struct:
    result = Struct()
    result.update(values)
    return result


class SglangSchedulerServicer(WorkerServicer, sglang_grpc.SglangSchedulerServicer):
    """The SGLang scheduler service for one engine (one data-parallel rank, no LoRA, text only).
    A request with ``n`` > 1 runs as ``n`` engine requests (``{request_id}-{i}``), interleaved.

    RPCs not overridden here (profiling, LoRA, KV-event subscription, flush) answer
    UNIMPLEMENTED; the router falls back to polling ``GetLoads``.
    """

    # --- generation -----------------------------------------------------------------------------

    def _plan(self, request: sglang_pb.GenerateRequest, info: pb.ModelInfo,
              arrival_time: float) -> SglangRequestPlan:
        return to_engine_requests(request, info, arrival_time=arrival_time)

    async def _generate_choice(self, plan: SglangRequestPlan,
                               index: int) -> AsyncIterator[sglang_pb.GenerateResponse]:
        """One choice's engine events → SGLang responses. Leaving early (a stop string, the router
        going away) closes the engine's iterator, which aborts the request and frees its KV blocks."""
        builder = SglangResponseBuilder(plan, index)
        async with contextlib.aclosing(self._choice_steps(builder)) as steps:
            async for step in steps:
                if isinstance(step, TokenStep):
                    chunk = builder.add_tokens(step.ids, step.logprobs)
                    if plan.stream and step.ids:
                        yield chunk
                    if step.matched_stop_str is not None:
                        yield builder.complete("stop", matched_stop_str=step.matched_stop_str)
                        return
                else:
                    matched = (step.matched_stop_token_id
                               if step.HasField("matched_stop_token_id") and step.reason == pb.FINISH_REASON_STOP
                               else None)
                    yield builder.complete(FINISH_REASONS.get(step.reason, "stop"), matched_token_id=matched)
                    return

    async def Abort(self, request: sglang_pb.AbortRequest,
                    context: grpc.aio.ServicerContext) -> sglang_pb.AbortResponse:
        found = await self._abort(request.request_id)
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
        healthy, message = self._health_message()
        return sglang_pb.HealthCheckResponse(healthy=healthy, message=message)

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

def add_sglang_service(server: grpc.aio.Server, engine: EngineHandle, *, served_model_name: str,
                       model_path: str, tokenizer_path: str) -> None:
    """Serve ``sglang.grpc.scheduler.SglangScheduler`` for ``engine`` on ``server`` (same port as
    ``openinfer.v1.Engine``). Paths are made absolute: the router loads the tokenizer from
    ``tokenizer_path`` when it shares the file system, else it asks ``GetTokenizer``."""
    servicer = SglangSchedulerServicer(engine, served_model_name=served_model_name,
                                       model_path=model_path, tokenizer_path=tokenizer_path)
    add_servicer(sglang_grpc.add_SglangSchedulerServicer_to_server, servicer, server)
