"""The gRPC server (grpc.aio): ``openinfer.v1.Engine`` over any ``EngineHandle``, the standard
``grpc.health.v1`` service, and server reflection.

Error mapping: ``InvalidRequestError`` → INVALID_ARGUMENT (trailing metadata ``openinfer-field``
names the field), ``QueueFullError`` → RESOURCE_EXHAUSTED (``retry-after``, ``openinfer-max-queue``),
``EngineDeadError`` → UNAVAILABLE. Invariant: a Generate call that ends without the engine's
``finished``/``error`` event (client cancelled, deadline, server stop) aborts its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from openinfer.engine import EngineHandle
from openinfer.errors import EngineDeadError, InvalidRequestError, PortInUseError, QueueFullError
from openinfer.frontend.grpc.auth import ApiKeyInterceptor
from openinfer.frontend.grpc.malformed import add_servicer
from openinfer.frontend.validation import check_generate_request
from openinfer.v1 import engine_pb2 as pb
from openinfer.v1 import engine_pb2_grpc

logger = logging.getLogger(__name__)

ENGINE_SERVICE = pb.DESCRIPTOR.services_by_name["Engine"].full_name
SGLANG_SERVICE = "sglang.grpc.scheduler.SglangScheduler"
HEALTH_POLL_S = 0.2  # health flips within 1 s of the engine (core) going away


class EngineServicer(engine_pb2_grpc.EngineServicer):
    def __init__(self, engine: EngineHandle):
        self.engine = engine

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.TokenEvent]:
        try:
            check_generate_request(request, self.engine.info())
            events = aiter(self.engine.generate(request))
            first = await anext(events)
        except InvalidRequestError as exc:
            context.set_trailing_metadata((("openinfer-field", exc.field or ""),))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except QueueFullError as exc:
            context.set_trailing_metadata((("retry-after", str(exc.retry_after_s)),
                                           ("openinfer-max-queue", str(exc.max_queue))))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except StopAsyncIteration:
            await context.abort(grpc.StatusCode.INTERNAL, "the engine ended the request without any event")
        ended = False
        try:
            event = first
            while True:
                ended = event.WhichOneof("event") in ("finished", "error")
                yield event
                if ended:
                    return
                event = await anext(events)
        except StopAsyncIteration:
            return
        finally:
            closer = getattr(events, "aclose", None)
            if closer is not None:
                with contextlib.suppress(Exception):
                    await closer()
            if not ended:
                await self.engine.abort(request.request_id)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(found=await self.engine.abort(request.request_id))

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        return self.engine.info()

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        return self.engine.health()

    async def GetLoad(self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext) -> pb.Load:
        return self.engine.load()


@dataclass
class GrpcServer:
    """A started server; ``port`` is the bound port (useful when asked for port 0)."""

    server: grpc.aio.Server
    port: int
    health: HealthServicer
    _poller: asyncio.Task

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop accepting calls; in-flight calls get ``grace_s`` to finish, then are cancelled
        (which aborts their engine requests)."""
        self._poller.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._poller
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


async def _poll_health(engine: EngineHandle, health: HealthServicer) -> None:
    """Mirror ``engine.health()`` into grpc.health.v1 (the overall status and the Engine service)."""
    while True:
        try:
            healthy = engine.health().healthy
        except Exception:  # a remote engine may be unreachable: report it as not serving
            healthy = False
        status = health_pb2.HealthCheckResponse.SERVING if healthy else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", ENGINE_SERVICE):
            await health.set(service, status)
        await asyncio.sleep(HEALTH_POLL_S)


async def start_grpc_server(engine: EngineHandle, host: str = "127.0.0.1", port: int = 50051,
                            api_key: str | None = None, sglang_model_name: str | None = None,
                            tokenizer_path: str | None = None, worker_protocol: str = "sglang") -> GrpcServer:
    """Start the server. With ``sglang_model_name`` a router worker service (for the ``smg``
    router) is served on the same port, under that model name, pointing routers at
    ``tokenizer_path`` (default: the engine's own tokenizer directory): the SGLang scheduler
    service, or with ``worker_protocol="vllm"`` smg's vLLM-engine service (one per port: the
    router tells a worker's protocol from the services it lists)."""
    if worker_protocol not in ("sglang", "vllm"):
        raise ValueError(f"worker_protocol must be 'sglang' or 'vllm', got {worker_protocol!r}")
    interceptors = [ApiKeyInterceptor(api_key)] if api_key else []
    # No SO_REUSEPORT: with it a second server would share a port already in use (and steal its
    # connections) instead of failing to start.
    options: list[tuple[str, int]] = [("grpc.so_reuseport", 0)]
    if sglang_model_name is not None:  # imported only when asked for: smg-grpc-proto is a large import
        from openinfer.frontend.grpc.sglang_service import SGLANG_SERVER_OPTIONS, add_sglang_service

        options += SGLANG_SERVER_OPTIONS
    server = grpc.aio.server(interceptors=interceptors, options=options)
    add_servicer(engine_pb2_grpc.add_EngineServicer_to_server, EngineServicer(engine), server)
    service_names = [ENGINE_SERVICE]
    if sglang_model_name is not None:
        info = engine.info()
        worker_args = dict(served_model_name=sglang_model_name, model_path=info.model_path,
                           tokenizer_path=tokenizer_path or info.tokenizer_path or info.model_path)
        if worker_protocol == "vllm":
            from openinfer.frontend.grpc.vllm_service import VLLM_SERVICE, add_vllm_service

            add_vllm_service(server, engine, **worker_args)
            service_names.append(VLLM_SERVICE)
        else:
            add_sglang_service(server, engine, **worker_args)
            service_names.append(SGLANG_SERVICE)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    service_names += [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(service_names, server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpcio raises when the port cannot be bound
        bound, cause = 0, exc
    else:
        cause = None
    if bound == 0:
        raise PortInUseError(f"the gRPC server cannot bind {address} (is the port in use by another process? "
                             "choose another --grpc-port, or 0 to disable gRPC)") from cause
    await server.start()
    poller = asyncio.create_task(_poll_health(engine, health))
    logger.info("gRPC server listening on %s:%d", host, bound)
    return GrpcServer(server, bound, health, poller)
