"""Undecodable request bytes answered INVALID_ARGUMENT instead of grpcio's UNKNOWN.

grpcio (aio) answers a request whose deserializer raises with ``UNKNOWN: Unexpected
DecodeError`` and gives the servicer no say: the status code of a deserialization failure
cannot be chosen. So the deserializer here never raises: it hands the servicer a
``MalformedRequest`` instead, and the wrapped method aborts with INVALID_ARGUMENT naming the
message type. Only unary-request methods are wrapped (every RPC openinfer serves is one).

    add_servicer(engine_pb2_grpc.add_EngineServicer_to_server, EngineServicer(engine), server)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError


@dataclass(frozen=True)
class MalformedRequest:
    """What the servicer receives instead of a request whose bytes did not decode."""

    message_type: str
    error: str

    def details(self) -> str:
        return (f"the request is not a valid {self.message_type} message ({self.error}); "
                "send a serialized protobuf message of that type")


def _tolerant(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    message_type = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    name = message_type.full_name if message_type is not None else "request"

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except (DecodeError, ValueError, TypeError) as exc:
            return MalformedRequest(name, str(exc) or type(exc).__name__)

    return parse


def _guard_unary(behavior: Callable) -> Callable:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details())
        return await behavior(request, context)

    return unary


def _guard_stream(behavior: Callable) -> Callable:
    async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details())
        async for response in behavior(request, context):
            yield response

    return unary_stream


def tolerant_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` with a never-raising deserializer and a method that refuses malformed input."""
    if handler.request_streaming or handler.request_deserializer is None:
        return handler
    if handler.unary_unary is not None:
        return handler._replace(request_deserializer=_tolerant(handler.request_deserializer),
                                unary_unary=_guard_unary(handler.unary_unary))
    if handler.unary_stream is not None:
        return handler._replace(request_deserializer=_tolerant(handler.request_deserializer),
                                unary_stream=_guard_stream(handler.unary_stream))
    return handler


class _CapturingServer:
    """Stands in for the server while generated ``add_*Servicer_to_server`` code registers."""

    def __init__(self) -> None:
        self.services: list[tuple[str, dict[str, grpc.RpcMethodHandler]]] = []

    def add_generic_rpc_handlers(self, handlers: Any) -> None:  # rebuilt from the captured dict
        pass

    def add_registered_method_handlers(self, service_name: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.services.append((service_name, handlers))


def add_servicer(add_to_server: Callable[[Any, Any], None], servicer: Any, server: grpc.aio.Server) -> None:
    """Register ``servicer`` as the generated ``add_to_server`` would, with every method guarded."""
    capture = _CapturingServer()
    add_to_server(servicer, capture)
    if not capture.services:
        raise RuntimeError(f"{add_to_server.__name__} registered no service; generated code of an unexpected form")
    for service_name, handlers in capture.services:
        guarded = {method: tolerant_handler(handler) for method, handler in handlers.items()}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service_name, guarded),))
        server.add_registered_method_handlers(service_name, guarded)
