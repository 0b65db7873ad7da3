"""API-key check for the gRPC server: ``authorization: Bearer KEY`` in the call metadata.

Invariant: with a key configured, every method but the standard health service answers
UNAUTHENTICATED to a call without the right key, before the servicer runs.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

import grpc

OPEN_SERVICES = ("/grpc.health.v1.Health/",)


def _denying_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as ``handler`` that only aborts."""

    async def deny(_request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(_request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator, as streaming handlers must be

    serializers = {"request_deserializer": handler.request_deserializer,
                   "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream, **serializers)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **serializers)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **serializers)
    return grpc.unary_unary_rpc_method_handler(deny, **serializers)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_key: str):
        self.expected = f"Bearer {api_key}"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_SERVICES):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = metadata.get("authorization", "")
        if isinstance(given, bytes):
            given = given.decode(errors="replace")
        if hmac.compare_digest(given.encode(), self.expected.encode()):
            return handler
        message = "missing API key: send metadata 'authorization: Bearer KEY'" if not given else "invalid API key"
        return _denying_handler(handler, message)
