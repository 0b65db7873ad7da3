"""The SGLang scheduler servicer over a fake EngineHandle, driven by a real gRPC client on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import os
import zipfile
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sglang_pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sglang_grpc
from tokenizers import Tokenizer as RawTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from openinfer.errors import InvalidRequestError, QueueFullError
from openinfer.frontend.grpc.sglang_service import (
    SGLANG_SERVER_OPTIONS,
    SglangSchedulerServicer,
    add_sglang_service,
)
from openinfer.v1 import engine_pb2 as pb

T = TypeVar("T")

WORDS = ["<unk>", "<eos>", "<|im_start|>", "<|im_end|>", "alpha", "beta", "gamma", "delta", "epsilon",
         "zeta", "eta", "theta", "user", "assistant", "hello", "world"]
EOS_ID = 1
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant{% endif %}")


def write_tiny_tokenizer(directory: Path) -> Path:
    """A word-level tokenizer.json + tokenizer_config.json (with a chat template) in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    raw = RawTokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    raw.pre_tokenizer = Whitespace()
    raw.add_special_tokens(["<eos>", "<|im_start|>", "<|im_end|>"])
    raw.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<eos>", "bos_token": None, "chat_template": CHAT_TEMPLATE}))
    return directory


class FakeEngine:
    """An EngineHandle that emits ``script`` (cycled) one token per step, honours max_tokens,
    eos / stop ids and aborts, and counts one KV block per running request."""

    def __init__(self, script: list[int] | None = None, token_delay: float = 0.0, max_model_len: int = 4096):
        self.script = script or [4, 5, 6, 7]
        self.token_delay = token_delay
        self.max_model_len = max_model_len
        self.requests: list[pb.GenerateRequest] = []
        self.aborted: list[str] = []
        self.closed: list[str] = []
        self.running: dict[str, asyncio.Event] = {}
        self.healthy = True
        self.fail_with: Exception | None = None

    def info(self) -> pb.ModelInfo:
        return pb.ModelInfo(model_id="fake", model_path="/models/fake", architectures=["FakeForCausalLM"],
                            model_type="fake", vocab_size=len(WORDS), max_model_len=self.max_model_len,
                            eos_token_ids=[EOS_ID], backend="numpy", plugin="fake", kv_block_size=16,
                            num_kv_blocks=8)

    def health(self) -> pb.HealthResponse:
        return pb.HealthResponse(healthy=self.healthy, message="" if self.healthy else "engine loop stopped")

    def load(self) -> pb.Load:
        return pb.Load(num_running=len(self.running), kv_blocks_used=len(self.running), kv_blocks_total=8)

    async def abort(self, request_id: str) -> bool:
        event = self.running.get(request_id)
        if event is None:
            return False
        self.aborted.append(request_id)
        event.set()
        return True

    async def close(self) -> None:
        for event in self.running.values():
            event.set()

    async def generate(self, request: pb.GenerateRequest) -> AsyncIterator[pb.TokenEvent]:
        self.requests.append(request)
        if self.fail_with is not None:
            raise self.fail_with
        rid = request.request_id
        aborted = self.running[rid] = asyncio.Event()
        limit = (request.stop.max_tokens if request.stop.HasField("max_tokens")
                 else self.max_model_len - len(request.prompt_token_ids))
        try:
            yield pb.TokenEvent(request_id=rid, scheduled=pb.TokenEvent.Scheduled(cached_tokens=2))
            for step in range(limit):
                await asyncio.sleep(self.token_delay)
                if aborted.is_set():
                    yield self._finished(request, pb.FINISH_REASON_ABORT, step)
                    return
                token = self.script[step % len(self.script)]
                tokens = pb.TokenEvent.Tokens(ids=[token])
                if request.logprobs:
                    tops = [pb.TopLogprob(token_id=token, logprob=-0.5), pb.TopLogprob(token_id=9, logprob=-1.5)]
                    tokens.logprobs.append(pb.TokenLogprob(logprob=-0.5, top=tops[: request.logprobs]))
                if request.prompt_logprobs and step == 0:
                    tokens.prompt_logprobs.extend(
                        pb.TokenLogprob(logprob=-float(i)) for i in range(1, len(request.prompt_token_ids)))
                yield pb.TokenEvent(request_id=rid, tokens=tokens)
                if token == EOS_ID or token in request.stop.stop_token_ids:
                    yield self._finished(request, pb.FINISH_REASON_STOP, step + 1, matched=token)
                    return
            yield self._finished(request, pb.FINISH_REASON_LENGTH, limit)
        finally:
            self.closed.append(rid)
            del self.running[rid]

    @staticmethod
    def _finished(request: pb.GenerateRequest, reason: int, count: int, matched: int | None = None) -> pb.TokenEvent:
        finished = pb.TokenEvent.Finished(reason=reason, prompt_tokens=len(request.prompt_token_ids),
                                          completion_tokens=count, cached_tokens=2)
        if matched is not None:
            finished.matched_stop_token_id = matched
        return pb.TokenEvent(request_id=request.request_id, finished=finished)


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> Path:
    return write_tiny_tokenizer(tmp_path / "model")


@contextlib.asynccontextmanager
async def on_loopback(add_service: Callable[[grpc.aio.Server], None], stub_class: Callable[[grpc.aio.Channel], T],
                      options: Sequence[tuple[str, int]] = ()) -> AsyncIterator[T]:
    """A stub for a loopback server that ``add_service`` put a worker service on (both worker tests)."""
    server = grpc.aio.server(options=list(options))
    add_service(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield stub_class(channel)
    finally:
        await channel.close()
        await server.stop(grace=None)


@pytest.fixture
async def served(tokenizer_dir: Path) -> AsyncIterator[tuple[FakeEngine, sglang_grpc.SglangSchedulerStub]]:
    engine = FakeEngine()

    def add(server: grpc.aio.Server) -> None:
        add_sglang_service(server, engine, served_model_name="tiny", model_path=str(tokenizer_dir),
                           tokenizer_path=os.path.relpath(tokenizer_dir))

    async with on_loopback(add, sglang_grpc.SglangSchedulerStub, SGLANG_SERVER_OPTIONS) as stub:
        yield engine, stub


def router_request(rid: str = "req-1", *, stream: bool = False, max_new_tokens: int | None = 3,
                   **params: object) -> sglang_pb.GenerateRequest:
    """A request as smg builds it: explicit SGLang defaults (temperature 1.0, top_k -1, ...)."""
    sampling = sglang_pb.SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0,
                                        skip_special_tokens=True, spaces_between_special_tokens=True, n=1)
    if max_new_tokens is not None:
        sampling.max_new_tokens = max_new_tokens
    for name, value in params.items():
        if isinstance(value, list):
            getattr(sampling, name).extend(value)
        else:
            setattr(sampling, name, value)
    return sglang_pb.GenerateRequest(request_id=rid, tokenized=sglang_pb.TokenizedInput(input_ids=[12, 14, 15]),
                                     sampling_params=sampling, logprob_start_len=-1, stream=stream)


async def collect(stub: sglang_grpc.SglangSchedulerStub, request: sglang_pb.GenerateRequest) -> list:
    return [response async for response in stub.Generate(request)]


async def test_model_info_reports_a_generation_model_with_absolute_paths(served, tokenizer_dir):
    _, stub = served
    info = await stub.GetModelInfo(sglang_pb.GetModelInfoRequest())
    assert info.is_generation is True
    assert info.served_model_name == "tiny"
    assert info.tokenizer_path == str(tokenizer_dir.resolve())
    assert os.path.isabs(info.model_path)
    assert (info.max_context_length, info.vocab_size, list(info.eos_token_ids)) == (4096, len(WORDS), [EOS_ID])
    assert list(info.architectures) == ["FakeForCausalLM"] and info.model_type == "fake"


async def test_health_check_follows_the_engine(served):
    engine, stub = served
    assert (await stub.HealthCheck(sglang_pb.HealthCheckRequest())).healthy is True
    engine.healthy = False
    response = await stub.HealthCheck(sglang_pb.HealthCheckRequest())
    assert response.healthy is False and "stopped" in response.message


async def test_non_stream_sends_one_complete_with_every_output_id(served):
    engine, stub = served
    responses = await collect(stub, router_request(max_new_tokens=3))
    assert [r.WhichOneof("response") for r in responses] == ["complete"]
    done = responses[0].complete
    assert list(done.output_ids) == [4, 5, 6]
    assert (done.finish_reason, done.prompt_tokens, done.completion_tokens, done.cached_tokens) == ("length", 3, 3, 2)
    assert done.WhichOneof("matched_stop") is None


async def test_router_default_sampling_maps_onto_openinfer(served):
    engine, stub = served
    await collect(stub, router_request(max_new_tokens=None, temperature=0.7, top_k=-1, min_new_tokens=1,
                                       stop_token_ids=[7], ignore_eos=True))
    request = engine.requests[-1]
    assert request.sampling.temperature == pytest.approx(0.7) and request.sampling.top_k == 0
    assert request.sampling.top_p == 1.0 and request.sampling.repetition_penalty == 1.0
    assert request.stop.max_tokens == 4096 - 3  # unset: the rest of the context
    assert list(request.stop.stop_token_ids) == [7] and request.stop.ignore_eos and request.stop.min_tokens == 1
    assert list(request.prompt_token_ids) == [12, 14, 15] and request.request_id == "req-1"


async def test_missing_sampling_params_mean_sglang_defaults_not_greedy(served):
    engine, stub = served
    bare = sglang_pb.GenerateRequest(request_id="bare", tokenized=sglang_pb.TokenizedInput(input_ids=[12]))
    await collect(stub, bare)
    assert engine.requests[-1].sampling.temperature == 1.0
    await collect(stub, router_request("greedy", temperature=0.0))
    assert engine.requests[-1].sampling.temperature == 0.0


async def test_stream_sends_chunks_then_one_complete(served):
    _, stub = served
    responses = await collect(stub, router_request(stream=True, max_new_tokens=3))
    kinds = [r.WhichOneof("response") for r in responses]
    assert kinds == ["chunk", "chunk", "chunk", "complete"]
    streamed = [t for r in responses[:-1] for t in r.chunk.token_ids]
    assert streamed == list(responses[-1].complete.output_ids) == [4, 5, 6]
    assert [r.chunk.completion_tokens for r in responses[:-1]] == [1, 2, 3]
    assert all(r.chunk.prompt_tokens == 3 and r.request_id == "req-1" for r in responses[:-1])


async def test_eos_finishes_with_stop_and_matched_token_id(served):
    engine, stub = served
    engine.script = [4, EOS_ID]
    done = (await collect(stub, router_request(max_new_tokens=10)))[-1].complete
    assert (list(done.output_ids), done.finish_reason, done.matched_token_id) == ([4, EOS_ID], "stop", EOS_ID)


async def test_stop_string_ends_generation_in_the_worker(served):
    engine, stub = served
    engine.script = [4, 5, 6, 7, 8]  # alpha beta gamma delta epsilon
    responses = await collect(stub, router_request(stream=True, max_new_tokens=20, stop=["gamma"]))
    done = responses[-1].complete
    assert list(done.output_ids) == [4, 5, 6]
    assert (done.finish_reason, done.matched_stop_str, done.completion_tokens) == ("stop", "gamma", 3)
    assert [t for r in responses[:-1] for t in r.chunk.token_ids] == [4, 5, 6]
    await asyncio.sleep(0.05)
    assert engine.closed == ["req-1"] and not engine.running  # the engine request was closed early


async def test_stop_string_spanning_two_tokens(served):
    engine, stub = served
    engine.script = [4, 5, 6, 7]
    done = (await collect(stub, router_request(max_new_tokens=20, stop=["beta gam"])))[-1].complete
    assert (list(done.output_ids), done.matched_stop_str) == ([4, 5, 6], "beta gam")


async def test_without_a_tokenizer_stop_strings_are_left_to_the_router(tmp_path):
    engine = FakeEngine()
    server = grpc.aio.server(options=SGLANG_SERVER_OPTIONS)
    add_sglang_service(server, engine, served_model_name="tiny", model_path=str(tmp_path), tokenizer_path="")
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = sglang_grpc.SglangSchedulerStub(channel)
            done = (await collect(stub, router_request(max_new_tokens=4, stop=["gamma"])))[-1].complete
            assert (list(done.output_ids), done.finish_reason) == ([4, 5, 6, 7], "length")
            assert done.WhichOneof("matched_stop") is None
    finally:
        await server.stop(grace=None)


async def test_logprobs_incremental_in_chunks_and_cumulative_in_complete(served):
    engine, stub = served
    request = router_request(stream=True, max_new_tokens=2)
    request.return_logprob, request.top_logprobs_num, request.logprob_start_len = True, 2, 0
    responses = await collect(stub, request)
    assert engine.requests[-1].logprobs == 2 and engine.requests[-1].prompt_logprobs
    first = responses[0].chunk
    assert list(first.output_logprobs.token_logprobs) == [-0.5] and list(first.output_logprobs.token_ids) == [4]
    assert list(first.output_logprobs.top_logprobs[0].token_ids) == [4, 9]
    inputs = first.input_logprobs
    assert list(inputs.token_ids) == [12, 14, 15]
    assert not inputs.token_logprobs[0].HasField("value") and inputs.token_logprobs[2].value == -2.0
    done = responses[-1].complete
    assert list(done.output_logprobs.token_logprobs) == [-0.5, -0.5]
    assert list(done.output_logprobs.token_ids) == [4, 5] and len(done.output_logprobs.top_logprobs) == 2


async def test_logprobs_without_top_asks_engine_for_the_sampled_token_only(served):
    engine, stub = served
    request = router_request(max_new_tokens=1)
    request.return_logprob = True
    done = (await collect(stub, request))[-1].complete
    assert engine.requests[-1].logprobs == 1 and not engine.requests[-1].prompt_logprobs
    assert list(done.output_logprobs.token_logprobs) == [-0.5] and len(done.output_logprobs.top_logprobs) == 0
    assert not done.HasField("input_logprobs")


async def test_n_choices_stream_interleaved_under_their_index(served):
    engine, stub = served
    responses = await collect(stub, router_request("multi", stream=True, max_new_tokens=2, n=3))
    assert sorted(r.request_id for r in engine.requests) == ["multi-0", "multi-1", "multi-2"]
    assert all(r.request_id == "multi" for r in responses)
    completes = sorted((r.complete for r in responses if r.WhichOneof("response") == "complete"),
                       key=lambda c: c.index)
    assert [(c.index, list(c.output_ids), c.finish_reason) for c in completes] == [
        (0, [4, 5], "length"), (1, [4, 5], "length"), (2, [4, 5], "length")]
    for index in range(3):
        chunks = [r.chunk for r in responses if r.WhichOneof("response") == "chunk" and r.chunk.index == index]
        assert [t for c in chunks for t in c.token_ids] == [4, 5]


async def test_n_choices_without_stream_send_one_complete_each(served):
    engine, stub = served
    responses = await collect(stub, router_request("multi", max_new_tokens=2, n=2))
    assert sorted((r.complete.index, r.WhichOneof("response")) for r in responses) == [(0, "complete"), (1, "complete")]


async def test_abort_rpc_stops_every_choice_and_going_away_closes_them(served):
    engine, stub = served
    engine.token_delay = 0.02
    call = stub.Generate(router_request("fan", stream=True, max_new_tokens=1000, n=2))
    await call.read()
    assert (await stub.Abort(sglang_pb.AbortRequest(request_id="fan"))).success is True
    rest = []
    while (response := await call.read()) is not grpc.aio.EOF:
        rest.append(response)
    assert sorted(r.complete.index for r in rest if r.WhichOneof("response") == "complete") == [0, 1]
    assert all(r.complete.finish_reason == "abort" for r in rest if r.WhichOneof("response") == "complete")
    assert sorted(engine.aborted) == ["fan-0", "fan-1"]
    call = stub.Generate(router_request("gone", stream=True, max_new_tokens=1000, n=2))
    await call.read()
    call.cancel()
    for _ in range(100):
        if not engine.running:
            break
        await asyncio.sleep(0.02)
    assert not engine.running and {"gone-0", "gone-1"} <= set(engine.closed)


async def test_abort_rpc_ends_a_running_stream_with_abort(served):
    engine, stub = served
    engine.token_delay = 0.02
    call = stub.Generate(router_request("long", stream=True, max_new_tokens=1000))
    first = await call.read()
    assert first.WhichOneof("response") == "chunk"
    response = await stub.Abort(sglang_pb.AbortRequest(request_id="long", reason="test"))
    assert response.success is True
    rest = []
    while (response := await call.read()) is not grpc.aio.EOF:
        rest.append(response)
    assert rest[-1].complete.finish_reason == "abort"
    missing = await stub.Abort(sglang_pb.AbortRequest(request_id="never-started"))
    assert missing.success is False and "not found" in missing.message


async def test_client_going_away_closes_the_engine_request(served):
    engine, stub = served
    engine.token_delay = 0.02
    call = stub.Generate(router_request("dropped", stream=True, max_new_tokens=1000))
    await call.read()
    assert (await stub.GetLoads(sglang_pb.GetLoadsRequest())).loads[0].num_running_reqs == 1
    call.cancel()
    for _ in range(100):
        if not engine.running:
            break
        await asyncio.sleep(0.02)
    assert engine.closed == ["dropped"] and not engine.running
    load = (await stub.GetLoads(sglang_pb.GetLoadsRequest())).loads[0]
    assert (load.num_running_reqs, load.num_used_tokens) == (0, 0)


async def test_get_loads_reports_engine_load(served):
    engine, stub = served
    engine.token_delay = 0.02
    call = stub.Generate(router_request("busy", stream=True, max_new_tokens=1000))
    await call.read()
    loads = await stub.GetLoads(sglang_pb.GetLoadsRequest(include=["all"]))
    load = loads.loads[0]
    assert (loads.dp_rank_count, load.dp_rank, load.num_running_reqs, load.num_total_reqs) == (1, 0, 1, 1)
    assert (load.num_used_tokens, load.max_total_num_tokens) == (16, 128)
    assert load.token_usage == pytest.approx(1 / 8) and load.memory.token_capacity == 128
    assert loads.aggregate.total_running_reqs == 1
    call.cancel()
    await collect(stub, router_request("done", max_new_tokens=3))
    load = (await stub.GetLoads(sglang_pb.GetLoadsRequest())).loads[0]
    assert load.gen_throughput > 0 and load.cache_hit_rate == pytest.approx(2 / 3)  # 2 of 3 prompt tokens cached


async def test_server_info_describes_the_worker(served, tokenizer_dir):
    _, stub = served
    info = await stub.GetServerInfo(sglang_pb.GetServerInfoRequest())
    args = dict(info.server_args.fields)
    assert args["served_model_name"].string_value == "tiny"
    assert args["tokenizer_path"].string_value == str(tokenizer_dir.resolve())
    assert args["context_length"].number_value == 4096 and args["is_embedding"].bool_value is False
    assert info.server_type == "grpc" and info.max_total_num_tokens == 128
    assert info.sglang_version.startswith("openinfer")


async def test_get_tokenizer_streams_a_verified_zip(served, tokenizer_dir):
    _, stub = served
    chunks = [c async for c in stub.GetTokenizer(common_pb2.GetTokenizerRequest())]
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert all(not c.sha256 for c in chunks[:-1])
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(names)


UNSUPPORTED = {
    "regex": lambda r: setattr(r.sampling_params, "regex", "[a-z"),
    "json_schema": lambda r: setattr(r.sampling_params, "json_schema", "{not json"),
    "grammar": lambda r: setattr(r.sampling_params, "ebnf_grammar", "root ::= (("),
    "structural_tag": lambda r: setattr(r.sampling_params, "structural_tag", "{}"),
    "n": lambda r: setattr(r.sampling_params, "n", 17),
    "logit_bias": lambda r: r.sampling_params.logit_bias.update({"five": 1.0}),
    "custom_params": lambda r: r.sampling_params.custom_params.update({"x": 1}),
    "max_new_tokens": lambda r: setattr(r.sampling_params, "max_new_tokens", 0),
    "temperature": lambda r: setattr(r.sampling_params, "temperature", -1.0),
    "lora_id": lambda r: setattr(r, "lora_id", "adapter-1"),
    "mm_inputs": lambda r: r.mm_inputs.image_urls.append("http://example.invalid/cat.png"),
    "input_embeds": lambda r: r.input_embeds.extend([0.1, 0.2]),
    "return_hidden_states": lambda r: setattr(r, "return_hidden_states", True),
    "custom_logit_processor": lambda r: setattr(r, "custom_logit_processor", "pickled"),
    "token_ids_logprob": lambda r: r.token_ids_logprob.append(5),
    "disaggregated_params": lambda r: setattr(r.disaggregated_params, "bootstrap_host", "10.0.0.1"),
    "data_parallel_rank": lambda r: setattr(r, "data_parallel_rank", 1),
    "input_ids": lambda r: r.tokenized.ClearField("input_ids"),
    "maximum context length": lambda r: setattr(r.sampling_params, "max_new_tokens", 5000),
    "vocabulary": lambda r: r.tokenized.input_ids.append(999),
}


async def test_constraints_and_logit_bias_reach_the_engine(served):
    engine, stub = served
    request = router_request()
    request.sampling_params.json_schema = '{"type": "object"}'
    request.sampling_params.logit_bias.update({"5": 100.0})
    await collect(stub, request)
    sent = engine.requests[-1]
    assert sent.structured_output.json_schema == '{"type": "object"}' and dict(sent.sampling.logit_bias) == {5: 100.0}
    request = router_request()
    request.sampling_params.ebnf_grammar = 'root ::= "a" | "b"'
    await collect(stub, request)
    assert engine.requests[-1].structured_output.grammar == 'root ::= "a" | "b"'


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
async def test_unsupported_fields_get_invalid_argument_not_a_crash(served, name):
    engine, stub = served
    request = router_request()
    UNSUPPORTED[name](request)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(stub, request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert name in caught.value.details()
    assert engine.requests == []
    assert len(await collect(stub, router_request("after"))) == 1  # the worker keeps serving


@pytest.mark.parametrize(("error", "code"), [
    (InvalidRequestError("prompt is longer than the context (64 tokens)", "prompt"), grpc.StatusCode.INVALID_ARGUMENT),
    (QueueFullError(4), grpc.StatusCode.RESOURCE_EXHAUSTED),
])
async def test_engine_refusals_map_to_grpc_status(served, error, code):
    engine, stub = served
    engine.fail_with = error
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(stub, router_request())
    assert caught.value.code() == code and str(error) in caught.value.details()


async def test_embed_is_refused_clearly(served):
    _, stub = served
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Embed(sglang_pb.EmbedRequest(request_id="e", tokenized=sglang_pb.TokenizedInput(input_ids=[4])))
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED and "generation" in caught.value.details()


class LoggingFakeEngine(FakeEngine):
    """FakeEngine that prints one line per request and per abort, for tests that run it as a worker
    process behind the router (``python test_sglang_service.py PORT MODEL_DIR``)."""

    async def generate(self, request: pb.GenerateRequest) -> AsyncIterator[pb.TokenEvent]:
        print(f"generate {request.request_id}", flush=True)
        async for event in super().generate(request):
            yield event

    async def abort(self, request_id: str) -> bool:
        found = await super().abort(request_id)
        print(f"abort {request_id} found={found}", flush=True)
        return found


class RemoteTokenizerServicer(SglangSchedulerServicer):
    """Reports a tokenizer path that does not exist where the router runs, as a worker on another
    machine would; ``GetTokenizer`` still serves the real files."""

    def __init__(self, *args, reported_path: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.reported_path = reported_path

    async def GetModelInfo(self, request, context):
        info = await super().GetModelInfo(request, context)
        info.model_path = info.tokenizer_path = self.reported_path
        return info

    async def GetServerInfo(self, request, context):
        info = await super().GetServerInfo(request, context)
        info.server_args["model_path"] = info.server_args["tokenizer_path"] = self.reported_path
        return info


async def serve_fake_worker(port: int, model_dir: Path, token_delay: float, reported_path: str | None) -> None:
    engine = LoggingFakeEngine(token_delay=token_delay)
    server = grpc.aio.server(options=SGLANG_SERVER_OPTIONS)
    paths = {"served_model_name": "tiny", "model_path": str(model_dir),
             "tokenizer_path": str(write_tiny_tokenizer(model_dir))}
    if reported_path is None:
        add_sglang_service(server, engine, **paths)
    else:
        servicer = RemoteTokenizerServicer(engine, reported_path=reported_path, **paths)
        sglang_grpc.add_SglangSchedulerServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    import sys

    asyncio.run(serve_fake_worker(int(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]),
                                  sys.argv[4] if len(sys.argv) > 4 else None))


async def test_start_grpc_server_points_routers_at_the_tokenizer_flag(tokenizer_dir, tmp_path):
    """``openinfer serve --tokenizer DIR`` reaches the SGLang service's GetModelInfo."""
    from openinfer.frontend.grpc import start_grpc_server

    engine = FakeEngine()
    server = await start_grpc_server(engine, "127.0.0.1", 0, sglang_model_name="tiny",
                                     tokenizer_path=str(tokenizer_dir.resolve()))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        info = await sglang_grpc.SglangSchedulerStub(channel).GetModelInfo(sglang_pb.GetModelInfoRequest())
        assert info.tokenizer_path == str(tokenizer_dir.resolve())
    finally:
        await channel.close()
        await server.stop()
