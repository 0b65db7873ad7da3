"""smg's vLLM-engine servicer over a fake EngineHandle, driven by a real gRPC client on loopback."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc
from test_sglang_service import EOS_ID, WORDS, FakeEngine, on_loopback, write_tiny_tokenizer

from openinfer.frontend.grpc.vllm_service import add_vllm_service


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[FakeEngine, vllm_grpc.VllmEngineStub]]:
    engine = FakeEngine()
    directory = write_tiny_tokenizer(tmp_path / "model")

    def add(server: grpc.aio.Server) -> None:
        add_vllm_service(server, engine, served_model_name="tiny", model_path=str(directory),
                         tokenizer_path=str(directory))

    async with on_loopback(add, vllm_grpc.VllmEngineStub) as stub:
        yield engine, stub


def request(rid: str = "req-1", *, stream: bool = False, max_tokens: int | None = 3,
            **params: object) -> vllm_pb.GenerateRequest:
    sampling = vllm_pb.SamplingParams(temperature=1.0, skip_special_tokens=True, n=1)
    if max_tokens is not None:
        sampling.max_tokens = max_tokens
    for name, value in params.items():
        field = getattr(sampling, name)
        if isinstance(value, list):
            field.extend(value)
        elif isinstance(value, dict):
            field.update(value)
        elif hasattr(value, "CopyFrom"):
            field.CopyFrom(value)
        else:
            setattr(sampling, name, value)
    return vllm_pb.GenerateRequest(request_id=rid, tokenized=vllm_pb.TokenizedInput(input_ids=[12, 14, 15]),
                                   sampling_params=sampling, stream=stream)


async def collect(stub, message) -> list:
    return [response async for response in stub.Generate(message)]


async def test_non_stream_is_one_complete_with_everything(served):
    _, stub = served
    [response] = await collect(stub, request(max_tokens=3))
    done = response.complete
    assert (list(done.output_ids), done.finish_reason, done.prompt_tokens, done.completion_tokens) == (
        [4, 5, 6], "length", 3, 3)
    assert done.cached_tokens == 2 and done.WhichOneof("matched_stop") is None


async def test_stream_sends_deltas_then_a_complete_with_the_last_delta(served):
    _, stub = served
    responses = await collect(stub, request(stream=True, max_tokens=3))
    assert [r.WhichOneof("response") for r in responses] == ["chunk", "chunk", "chunk", "complete"]
    assert [list(r.chunk.token_ids) for r in responses[:3]] == [[4], [5], [6]]
    assert all(r.chunk.completion_tokens == 1 for r in responses[:3])
    assert list(responses[-1].complete.output_ids) == [6] and responses[-1].complete.finish_reason == "length"


async def test_sampling_logit_bias_and_constraint_reach_the_engine(served):
    engine, stub = served
    await collect(stub, request(seed=5, top_k=0, top_p=0.0, logit_bias={4: 100.0, 7: -100.0},
                                json_schema='{"type": "object"}'))
    sent = engine.requests[-1]
    assert sent.sampling.temperature == 1.0 and sent.sampling.top_p == 1.0 and sent.sampling.seed == 5
    assert dict(sent.sampling.logit_bias) == {4: 100.0, 7: -100.0}
    assert json.loads(sent.structured_output.json_schema) == {"type": "object"}
    await collect(stub, request(choice=vllm_pb.ChoiceConstraint(choices=["yes", "no"])))
    assert list(engine.requests[-1].structured_output.choice.choices) == ["yes", "no"]
    unset = request()
    unset.sampling_params.ClearField("temperature")
    await collect(stub, unset)
    assert engine.requests[-1].sampling.temperature == 1.0  # vLLM's default, not proto3's 0


async def test_n_choices_have_their_own_index_ids_and_seeds(served):
    engine, stub = served
    responses = await collect(stub, request(n=3, seed=10, max_tokens=2))
    assert sorted(r.complete.index for r in responses) == [0, 1, 2]
    assert sorted(r.request_id for r in engine.requests[-3:]) == ["req-1-0", "req-1-1", "req-1-2"]
    assert sorted(r.sampling.seed for r in engine.requests[-3:]) == [10, 11, 12]


async def test_logprobs_and_prompt_logprobs(served):
    _, stub = served
    [response] = await collect(stub, request(max_tokens=2, logprobs=2, prompt_logprobs=1))
    done = response.complete
    assert list(done.output_logprobs.token_logprobs) == [-0.5, -0.5]
    assert [list(t.token_ids) for t in done.output_logprobs.top_logprobs] == [[4, 9], [5, 9]]
    prompt = done.input_logprobs
    assert list(prompt.token_ids) == [12, 14, 15]
    assert not prompt.token_logprobs[0].HasField("value")
    assert [t.value for t in prompt.token_logprobs[1:]] == [-1.0, -2.0]
    streamed = await collect(stub, request(stream=True, max_tokens=2, logprobs=1, prompt_logprobs=0))
    assert streamed[0].chunk.HasField("input_logprobs") and not streamed[1].chunk.HasField("input_logprobs")


async def test_stop_token_and_stop_string_are_reported(served):
    engine, stub = served
    [response] = await collect(stub, request(max_tokens=8, stop_token_ids=[6]))
    assert response.complete.finish_reason == "stop" and response.complete.matched_token_id == 6
    engine.script = [4, 5, EOS_ID]
    [response] = await collect(stub, request(max_tokens=8))
    assert response.complete.WhichOneof("matched_stop") is None  # eos is not a stop token
    engine.script = [4, 5, 6, 7]
    [response] = await collect(stub, request(max_tokens=8, stop=["beta gamma"]))
    assert response.complete.matched_stop_str == "beta gamma"
    assert list(response.complete.output_ids) == [4, 5, 6]


@pytest.mark.parametrize("mutate, field", [
    (lambda r: r.sampling_params.MergeFrom(vllm_pb.SamplingParams(structural_tag="{}")), "structural_tag"),
    (lambda r: r.sampling_params.MergeFrom(vllm_pb.SamplingParams(json_schema="{not json")), "json_schema"),
    (lambda r: r.sampling_params.MergeFrom(vllm_pb.SamplingParams(regex="a(")), "regex"),
    (lambda r: r.sampling_params.MergeFrom(vllm_pb.SamplingParams(logprobs=-1)), "logprobs"),
    (lambda r: r.sampling_params.logit_bias.update({10**6: 1.0}), "logit_bias"),
    (lambda r: r.sampling_params.logit_bias.update({4: 500.0}), "logit_bias"),
    (lambda r: r.sampling_params.MergeFrom(vllm_pb.SamplingParams(n=99)), "n"),
    (lambda r: setattr(r.sampling_params, "temperature", float("nan")), "temperature"),  # not greedy
    (lambda r: setattr(r.sampling_params, "top_p", float("inf")), "top_p"),
    (lambda r: r.CopyFrom(vllm_pb.GenerateRequest(request_id="x", text="hello")), "tokenized"),
    (lambda r: r.MergeFrom(vllm_pb.GenerateRequest(kv_transfer_params_json="{}")), "kv_transfer"),
])
async def test_bad_requests_are_invalid_argument_and_the_worker_keeps_serving(served, mutate, field):
    _, stub = served
    bad = request()
    mutate(bad)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await collect(stub, bad)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field.split("_")[0] in error.value.details()
    assert (await collect(stub, request()))[0].complete.finish_reason == "length"


async def test_abort_reaches_the_engine(served):
    engine, stub = served
    engine.token_delay = 0.05
    call = stub.Generate(request(stream=True, max_tokens=100))
    await call.read()
    await call.read()
    await stub.Abort(vllm_pb.AbortRequest(request_ids=["req-1"]))
    rest = []
    while (response := await call.read()) is not grpc.aio.EOF:
        rest.append(response)
    assert rest[-1].complete.finish_reason == "abort"
    assert engine.aborted == ["req-1"]


async def test_model_server_loads_and_tokenizer(served, tmp_path):
    engine, stub = served
    info = await stub.GetModelInfo(vllm_pb.GetModelInfoRequest())
    assert (info.served_model_name, info.vocab_size, list(info.eos_token_ids), info.is_generation) == (
        "tiny", len(WORDS), [EOS_ID], True)
    server = await stub.GetServerInfo(vllm_pb.GetServerInfoRequest())
    assert server.server_type == "vllm-grpc" and server.constrained_decoding_start == "first_token"
    loads = await stub.GetLoads(vllm_pb.GetLoadsRequest())
    assert loads.dp_rank_count == 1 and loads.loads[0].num_running_reqs == 0
    health = await stub.HealthCheck(vllm_pb.HealthCheckRequest())
    assert health.healthy
    chunks = [c async for c in stub.GetTokenizer(common_pb2.GetTokenizerRequest())]
    assert chunks and all(c.data for c in chunks)
