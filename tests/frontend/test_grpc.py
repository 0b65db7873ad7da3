"""The gRPC server over the fake engine, driven by a real grpc.aio client; and ``GrpcEngineClient``."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from conftest import LoopThread, wait_until
from fakes import FakeEngine
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from openinfer.errors import InvalidRequestError, QueueFullError
from openinfer.frontend.grpc import GrpcEngineClient, start_grpc_server
from openinfer.v1 import engine_pb2 as pb
from openinfer.v1 import engine_pb2_grpc

VOCAB = 64
EOS = 1
KEY = "grpc-sekret"


@pytest.fixture(scope="module")
def loop_thread():
    with LoopThread() as thread:
        yield thread


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine(VOCAB, [EOS], max_model_len=128, num_kv_blocks=64)


@pytest.fixture(scope="module")
def address(loop_thread, engine):
    server = loop_thread.run(start_grpc_server(engine, "127.0.0.1", 0))
    yield f"127.0.0.1:{server.port}"
    loop_thread.run(server.stop(0.5))


@pytest.fixture(scope="module")
def keyed_address(loop_thread, engine):
    server = loop_thread.run(start_grpc_server(engine, "127.0.0.1", 0, api_key=KEY))
    yield f"127.0.0.1:{server.port}"
    loop_thread.run(server.stop(0.5))


@pytest.fixture
def restore_engine(engine):
    saved = (engine.token_delay_s, engine.max_running)
    yield engine
    engine.token_delay_s, engine.max_running = saved


def request(request_id: str, prompt, max_tokens: int = 8, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, prompt_token_ids=prompt,
                              sampling=pb.SamplingParams(**sampling),
                              stop=pb.StopConditions(max_tokens=max_tokens))


async def collect(stub, req: pb.GenerateRequest, metadata=()) -> list[pb.TokenEvent]:
    return [event async for event in stub.Generate(req, metadata=metadata)]


def token_ids(events) -> list[int]:
    return [i for e in events if e.HasField("tokens") for i in e.tokens.ids]


async def test_generate_streams_concurrent_requests(address):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        prompts = {f"c{i}": [10 + i, 20 + i, 30 + i] for i in range(4)}
        results = await asyncio.gather(*(collect(stub, request(rid, p, max_tokens=7)) for rid, p in prompts.items()))
    for (rid, prompt), events in zip(prompts.items(), results, strict=True):
        assert all(e.request_id == rid for e in events)
        assert events[0].HasField("scheduled") and events[-1].HasField("finished")
        assert token_ids(events) == (prompt * 3)[:7]
        finished = events[-1].finished
        assert (finished.reason, finished.prompt_tokens, finished.completion_tokens) == \
            (pb.FINISH_REASON_LENGTH, 3, 7)


async def test_unset_max_tokens_runs_to_the_end_of_the_context(address):
    unset = pb.GenerateRequest(request_id="to-the-end", prompt_token_ids=[10, 11, 12],
                               stop=pb.StopConditions(ignore_eos=True))
    async with grpc.aio.insecure_channel(address) as channel:
        events = await collect(engine_pb2_grpc.EngineStub(channel), unset)
    assert len(token_ids(events)) == 128 - 3 and events[-1].finished.reason == pb.FINISH_REASON_LENGTH


async def test_abort_rpc_ends_the_stream(address, restore_engine):
    restore_engine.token_delay_s = 0.02
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        call = stub.Generate(request("to-abort", [5, 6], max_tokens=100))
        seen = []
        async for event in call:
            seen.append(event)
            if len(seen) == 3:
                assert (await stub.Abort(pb.AbortRequest(request_id="to-abort"))).found
        assert seen[-1].finished.reason == pb.FINISH_REASON_ABORT
        assert not (await stub.Abort(pb.AbortRequest(request_id="to-abort"))).found
    assert restore_engine.blocks_used() == 0


async def test_cancelled_call_aborts_the_request(address, restore_engine):
    restore_engine.token_delay_s = 0.02
    async with grpc.aio.insecure_channel(address) as channel:
        call = engine_pb2_grpc.EngineStub(channel).Generate(request("to-cancel", [5, 6], max_tokens=100))
        for _ in range(3):
            await call.read()
        assert "to-cancel" in restore_engine.running
        call.cancel()
    assert await asyncio.to_thread(wait_until, lambda: "to-cancel" not in restore_engine.running)
    assert "to-cancel" in restore_engine.aborted and restore_engine.blocks_used() == 0


async def test_health_info_and_load(address, engine):
    async with grpc.aio.insecure_channel(address) as channel:
        standard = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        assert standard.status == health_pb2.HealthCheckResponse.SERVING
        named = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="openinfer.v1.Engine"))
        assert named.status == health_pb2.HealthCheckResponse.SERVING
        stub = engine_pb2_grpc.EngineStub(channel)
        assert (await stub.Health(pb.HealthRequest())).healthy
        info = await stub.GetModelInfo(pb.GetModelInfoRequest())
        assert (info.vocab_size, info.max_model_len) == (VOCAB, 128)
        load = await stub.GetLoad(pb.GetLoadRequest())
        assert load.kv_blocks_total == 64


def test_reflection_lists_the_services(address):
    with grpc.insecure_channel(address) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"openinfer.v1.Engine", "grpc.health.v1.Health"} <= services


INVALID = {
    "empty request id": (request("", [1, 2]), "request_id"),
    "empty prompt": (request("e1", []), "prompt_token_ids"),
    "token outside vocab": (request("e2", [1, VOCAB + 5]), "prompt_token_ids"),
    "max_tokens zero": (request("e3", [3], max_tokens=0), "max_tokens"),
    "beyond context": (request("e4", [3] * 100, max_tokens=100), "max_tokens"),
    "negative temperature": (request("e5", [3], temperature=-1.0), "temperature"),
    "top_p above one": (request("e6", [3], top_p=1.5), "top_p"),
    "too many logprobs": (pb.GenerateRequest(request_id="e7", prompt_token_ids=[3], logprobs=99,
                                             stop=pb.StopConditions(max_tokens=2)), "logprobs"),
}


@pytest.mark.parametrize("case", sorted(INVALID))
async def test_invalid_argument(address, case):
    req, field = INVALID[case]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(stub, req)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field.split("_")[0] in info.value.details()
        assert dict(info.value.trailing_metadata())["openinfer-field"] == field
        assert token_ids(await collect(stub, request("after-" + case.replace(" ", "-"), [4], 1))) == [4]


async def test_full_queue_is_resource_exhausted(address, restore_engine):
    restore_engine.max_running = 0
    async with grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(engine_pb2_grpc.EngineStub(channel), request("full", [3]))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(info.value.trailing_metadata())["retry-after"] == "2"


async def test_api_key_metadata(keyed_address):
    async with grpc.aio.insecure_channel(keyed_address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        for call in (stub.GetModelInfo(pb.GetModelInfoRequest()),
                     collect(stub, request("nokey", [3]))):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=(("authorization", "Bearer wrong"),))
        good = (("authorization", f"Bearer {KEY}"),)
        assert (await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=good)).vocab_size == VOCAB
        assert token_ids(await collect(stub, request("key", [3, 4], 2), metadata=good)) == [3, 4]
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no key


# --- GrpcEngineClient: the EngineHandle over gRPC ---------------------------------------------------


async def test_client_is_an_engine_handle(address, engine):
    client = GrpcEngineClient(f"grpc://{address}")
    try:
        assert client.info().vocab_size == VOCAB and client.health().healthy
        assert client.load().kv_blocks_total == 64
        events = [e async for e in client.generate(request("via-client", [7, 8, 9], 5, temperature=1.0, seed=4))]
        direct = [e async for e in _direct(engine, request("direct", [7, 8, 9], 5, temperature=1.0, seed=4))]
        assert token_ids(events) == token_ids(direct)
        with pytest.raises(InvalidRequestError) as invalid:
            [e async for e in client.generate(request("bad", []))]
        assert invalid.value.field == "prompt_token_ids"
    finally:
        await client.close()


async def _direct(engine: FakeEngine, req: pb.GenerateRequest):
    async for event in engine.generate(req):
        yield event


async def test_client_maps_queue_full_and_closing_aborts(address, restore_engine):
    client = GrpcEngineClient(f"grpc://{address}")
    try:
        restore_engine.max_running = 0
        with pytest.raises(QueueFullError) as full:
            [e async for e in client.generate(request("full", [3]))]
        assert full.value.retry_after_s == 2
        restore_engine.max_running = 64
        restore_engine.token_delay_s = 0.02
        events = client.generate(request("closed-early", [3, 4], max_tokens=100))
        for _ in range(3):
            await anext(events)
        await events.aclose()
        assert await asyncio.to_thread(wait_until, lambda: "closed-early" not in restore_engine.running)
        assert "closed-early" in restore_engine.aborted
    finally:
        await client.close()


def test_client_rejects_a_bad_address():
    with pytest.raises(InvalidRequestError, match="grpc://HOST:PORT"):
        GrpcEngineClient("http://example/x")
