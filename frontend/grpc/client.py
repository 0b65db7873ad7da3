"""``GrpcEngineClient``: an ``EngineHandle`` whose engine runs behind an ``openinfer.v1.Engine`` gRPC server.

The async side (``generate``, ``abort``) uses a grpc.aio channel; the protocol's synchronous
methods (``info``, ``health``, ``load``) use a blocking channel with a short deadline, and
``info`` is fetched once (model facts do not change). Status codes map back onto openinfer's
errors, so a frontend in front of a remote engine answers exactly as in front of a local one:
INVALID_ARGUMENT → ``InvalidRequestError``, RESOURCE_EXHAUSTED → ``QueueFullError``, anything
else → ``EngineDeadError``. Closing a ``generate`` iterator early cancels the call, which makes
the server abort the request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from openinfer.errors import EngineDeadError, InvalidRequestError, QueueFullError
from openinfer.v1 import engine_pb2 as pb
from openinfer.v1 import engine_pb2_grpc

SYNC_TIMEOUT_S = 5.0


def parse_target(url: str) -> str:
    """``grpc://host:port`` (or a bare ``host:port``) → the channel target ``host:port``."""
    target = url.removeprefix("grpc://")
    if not target or "/" in target or ":" not in target:
        raise InvalidRequestError(f"engine address {url!r} must look like grpc://HOST:PORT", "engine")
    return target


def _metadata_value(error: grpc.aio.AioRpcError | grpc.RpcError, key: str) -> str | None:
    for item in error.trailing_metadata() or ():
        if item[0] == key:
            value = item[1]
            return value.decode() if isinstance(value, bytes) else value
    return None


def map_rpc_error(error: grpc.RpcError) -> Exception:
    code = error.code()
    details = error.details() or code.name
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequestError(details, _metadata_value(error, "openinfer-field") or None)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        max_queue = int(_metadata_value(error, "openinfer-max-queue") or 0)
        return QueueFullError(max_queue, int(_metadata_value(error, "retry-after") or 1))
    return EngineDeadError(f"remote engine call failed with {code.name}: {details}")


class GrpcEngineClient:
    def __init__(self, url: str, api_key: str | None = None):
        self.target = parse_target(url)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._sync_channel = grpc.insecure_channel(self.target)
        self._sync_stub = engine_pb2_grpc.EngineStub(self._sync_channel)
        self._channel: grpc.aio.Channel | None = None
        self._stub: engine_pb2_grpc.EngineStub | None = None
        self._info: pb.ModelInfo | None = None

    def _async_stub(self) -> engine_pb2_grpc.EngineStub:
        """The aio channel is created on first use, inside the event loop that will use it."""
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(self.target)
            self._stub = engine_pb2_grpc.EngineStub(self._channel)
        return self._stub

    def wait_until_ready(self, timeout_s: float) -> pb.ModelInfo:
        """Block until the remote engine answers (it may still be starting), at most ``timeout_s``."""
        try:
            self._info = self._sync_stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self.metadata,
                                                      timeout=timeout_s, wait_for_ready=True)
        except grpc.RpcError as exc:
            raise map_rpc_error(exc) from exc
        return self._info

    def info(self) -> pb.ModelInfo:
        if self._info is None:
            try:
                self._info = self._sync_stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self.metadata,
                                                          timeout=SYNC_TIMEOUT_S)
            except grpc.RpcError as exc:
                raise map_rpc_error(exc) from exc
        return self._info

    def health(self) -> pb.HealthResponse:
        try:
            return self._sync_stub.Health(pb.HealthRequest(), metadata=self.metadata, timeout=SYNC_TIMEOUT_S)
        except grpc.RpcError as exc:
            return pb.HealthResponse(healthy=False, message=f"remote engine at {self.target}: {exc.code().name}")

    def load(self) -> pb.Load:
        try:
            return self._sync_stub.GetLoad(pb.GetLoadRequest(), metadata=self.metadata, timeout=SYNC_TIMEOUT_S)
        except grpc.RpcError:
            return pb.Load()

    async def generate(self, request: pb.GenerateRequest) -> AsyncIterator[pb.TokenEvent]:
        call = self._async_stub().Generate(request, metadata=self.metadata)
        try:
            async for event in call:
                yield event
        except grpc.aio.AioRpcError as exc:
            raise map_rpc_error(exc) from exc
        finally:
            call.cancel()  # no-op once the call is done; otherwise the server aborts the request

    async def abort(self, request_id: str) -> bool:
        try:
            response = await self._async_stub().Abort(pb.AbortRequest(request_id=request_id),
                                                      metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            raise map_rpc_error(exc) from exc
        return response.found

    async def close(self) -> None:
        """Closes the channels only: the remote engine keeps running for its other clients."""
        if self._channel is not None:
            await self._channel.close()
            self._channel, self._stub = None, None
        self._sync_channel.close()
