"""The Python side of the contract: ``EngineHandle``.

Frontends (HTTP, gRPC, the CLI) talk to engines only through this protocol, whose inputs
and outputs are the proto messages of ``proto/openinfer/v1/engine.proto`` themselves. A
local engine, a remote one over gRPC (``GrpcEngineClient``) and a plugin's own engine are
interchangeable behind it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from openinfer.v1 import engine_pb2 as pb

GenerateRequest = pb.GenerateRequest
TokenEvent = pb.TokenEvent
ModelInfo = pb.ModelInfo
Load = pb.Load
HealthResponse = pb.HealthResponse
SamplingParams = pb.SamplingParams
StopConditions = pb.StopConditions
FinishReason = pb.FinishReason
ErrorCode = pb.ErrorCode


@runtime_checkable
class EngineHandle(Protocol):
    """What every engine offers. Event order per request: at most one ``scheduled``, any
    number of ``tokens``, then exactly one ``finished`` or ``error`` (always the last)."""

    def info(self) -> pb.ModelInfo:
        """Static facts about the served model (vocab, context, eos ids, tokenizer path)."""
        ...

    def generate(self, request: pb.GenerateRequest) -> AsyncIterator[pb.TokenEvent]:
        """Submit a request and stream its events. Invalid requests raise
        ``InvalidRequestError`` and a full queue ``QueueFullError`` before the first event.
        Closing the iterator early aborts the request."""
        ...

    async def abort(self, request_id: str) -> bool:
        """Abort a running or waiting request; True when it was found."""
        ...

    def health(self) -> pb.HealthResponse:
        ...

    def load(self) -> pb.Load:
        ...

    async def close(self) -> None:
        """Finish or abort in-flight requests and release the device."""
        ...


def finish_reason_name(reason: int) -> str:
    """OpenAI's spelling of a FinishReason ('stop', 'length', 'abort', 'error')."""
    return {
        pb.FINISH_REASON_STOP: "stop",
        pb.FINISH_REASON_LENGTH: "length",
        pb.FINISH_REASON_ABORT: "abort",
        pb.FINISH_REASON_ERROR: "error",
    }.get(reason, "stop")
