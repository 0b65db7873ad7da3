"""gRPC hardening (issue 11): bytes that are no protobuf message and non-finite sampling values
are INVALID_ARGUMENT on every service (openinfer.v1.Engine, the SGLang and the vLLM-engine
worker services; not UNKNOWN, not silently greedy); a gRPC port in use fails to start."""

from __future__ import annotations

import socket

import grpc
import pytest
from fakes import FakeEngine
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sglang_pb
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb

from openinfer.errors import PortInUseError
from openinfer.frontend.grpc import start_grpc_server
from openinfer.v1 import engine_pb2 as pb

GARBAGE = b"\xff\xff\xff\x07not a protobuf message"


@pytest.fixture(params=["sglang", "vllm"])
async def served(tokenizer_dir, request):
    engine = FakeEngine(400, [2], max_model_len=128, tokenizer_path=str(tokenizer_dir))
    server = await start_grpc_server(engine, "127.0.0.1", 0, sglang_model_name="tiny", worker_protocol=request.param)
    engine.worker_protocol = request.param
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield engine, channel, server.port
    finally:
        await channel.close()
        await server.stop(0)


async def _status(call) -> grpc.StatusCode:
    try:
        if hasattr(call, "__aiter__"):
            async for _ in call:
                pass
        else:
            await call
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details()
    return grpc.StatusCode.OK, ""


METHODS = {  # (method, streaming) per service: openinfer's own, then each worker protocol's
    "openinfer": [("/openinfer.v1.Engine/Generate", True), ("/openinfer.v1.Engine/Abort", False)],
    "sglang": [("/sglang.grpc.scheduler.SglangScheduler/Generate", True),
               ("/sglang.grpc.scheduler.SglangScheduler/GetLoads", False)],
    "vllm": [("/vllm.grpc.engine.VllmEngine/Generate", True), ("/vllm.grpc.engine.VllmEngine/GetLoads", False)],
}


@pytest.mark.parametrize("service", ["openinfer", "worker"])
async def test_garbage_bytes_are_invalid_argument(served, service):
    engine, channel, _ = served
    for method, streaming in METHODS[engine.worker_protocol if service == "worker" else service]:
        make = channel.unary_stream if streaming else channel.unary_unary
        call = make(method, request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw)(GARBAGE)
        code, details = await _status(call)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, details)
        assert "not a valid" in details
        assert engine.submitted == []
        # the server keeps serving well-formed calls
        info = await channel.unary_unary("/openinfer.v1.Engine/GetModelInfo",
                                         request_serializer=pb.GetModelInfoRequest.SerializeToString,
                                         response_deserializer=pb.ModelInfo.FromString)(pb.GetModelInfoRequest())
        assert info.vocab_size == 400


SAMPLING_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def _sampling_call(channel, service: str, field: str, value: float):
    """A Generate call of ``service`` whose sampling ``field`` is ``value`` (everything else valid)."""
    if service == "openinfer":
        sampling = pb.SamplingParams(temperature=1.0, top_p=1.0, repetition_penalty=1.0)
        setattr(sampling, field, value)
        message = pb.GenerateRequest(request_id="r", prompt_token_ids=[5, 6], sampling=sampling,
                                     stop=pb.StopConditions(max_tokens=2))
        method, message_type = "/openinfer.v1.Engine/Generate", pb.GenerateRequest
    elif service == "sglang":
        sampling = sglang_pb.SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0,
                                            max_new_tokens=2, n=1)
        setattr(sampling, field, value)
        message = sglang_pb.GenerateRequest(request_id="r", tokenized=sglang_pb.TokenizedInput(input_ids=[5, 6]),
                                            sampling_params=sampling)
        method, message_type = "/sglang.grpc.scheduler.SglangScheduler/Generate", sglang_pb.GenerateRequest
    else:
        sampling = vllm_pb.SamplingParams(temperature=1.0, top_p=1.0, repetition_penalty=1.0, max_tokens=2, n=1)
        setattr(sampling, field, value)
        message = vllm_pb.GenerateRequest(request_id="r", tokenized=vllm_pb.TokenizedInput(input_ids=[5, 6]),
                                          sampling_params=sampling)
        method, message_type = "/vllm.grpc.engine.VllmEngine/Generate", vllm_pb.GenerateRequest
    return channel.unary_stream(method, request_serializer=message_type.SerializeToString,
                                response_deserializer=lambda raw: raw)(message)


@pytest.mark.parametrize("service", ["openinfer", "worker"])
@pytest.mark.parametrize("field", SAMPLING_FLOATS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
async def test_non_finite_sampling_values_are_invalid_argument_on_every_service(served, service, field, value):
    """NaN compares false with every bound: each service must refuse it, not read it as greedy,
    "unset" or a default (issue 11.13), on openinfer's own service and on the router's worker
    service of either protocol."""
    engine, channel, _ = served
    code, details = await _status(_sampling_call(channel, engine.worker_protocol if service == "worker" else service,
                                                 field, value))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and field in details, (code, details)
    assert engine.submitted == []


@pytest.mark.parametrize("field", ["top_p", "repetition_penalty"])
async def test_negative_top_p_and_repetition_penalty_are_refused_on_the_worker_service(served, field):
    """The worker protocols send 0 for "unset"; a negative value is no "unset" and must not become the default."""
    engine, channel, _ = served
    code, details = await _status(_sampling_call(channel, engine.worker_protocol, field, -0.5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and field in details, (code, details)
    assert engine.submitted == []


async def test_grpc_port_in_use_fails_to_start(served):
    engine, _, port = served
    with pytest.raises(PortInUseError, match="--grpc-port"):
        await start_grpc_server(engine, "127.0.0.1", port)


async def test_grpc_port_held_by_a_plain_socket_fails_too():
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        with pytest.raises(PortInUseError):
            await start_grpc_server(FakeEngine(10), "127.0.0.1", holder.getsockname()[1])
    finally:
        holder.close()
