"""``vllm.grpc.engine.VllmEngine`` over any ``EngineHandle``: smg's vLLM-engine worker protocol.

The ``smg`` router in gRPC mode applies chat templates, parses tool calls and reasoning and
serves the Responses API itself; the worker turns token ids into token ids with the sampling
the router asks for (``n``, logprobs, prompt logprobs, stop ids and strings, logit_bias, the
structured-output constraint). Responses follow vLLM's own servicer: with ``stream``, a chunk
per engine token event (ids, counts and logprobs as deltas) and, when a choice ends, a
``complete`` carrying that last delta; without, one ``complete`` per choice with everything.

Served beside (or instead of) the SGLang scheduler service: ``start_grpc_server(...,
worker_protocol="vllm")`` / ``openinfer serve --grpc-worker-protocol vllm``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc

from openinfer.engine import EngineHandle
from openinfer.errors import EngineDeadError, InvalidRequestError, QueueFullError
from openinfer.frontend.grpc.malformed import add_servicer
from openinfer.frontend.grpc.sglang_fanout import merge_streams
from openinfer.frontend.grpc.sglang_load import RecentRates
from openinfer.frontend.grpc.sglang_stop import StopStringWatcher
from openinfer.frontend.grpc.sglang_tokenizer_bundle import build_tokenizer_zip, iter_bundle_chunks
from openinfer.frontend.grpc.vllm_convert import VllmRequestPlan, to_engine_requests
from openinfer.frontend.validation import check_generate_request
from openinfer.tokenizer import Tokenizer
from openinfer.v1 import engine_pb2 as pb

VLLM_SERVICE = "vllm.grpc.engine.VllmEngine"
FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                  pb.FINISH_REASON_ABORT: "abort"}
_ENGINE_ERROR_STATUS = {
    pb.ERROR_CODE_INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    pb.ERROR_CODE_RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    pb.ERROR_CODE_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}


class _EngineFailure(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def _top(row: pb.TokenLogprob | None, num: int) -> vllm_pb.TopLogProbs:
    if row is None or num <= 0:
        return vllm_pb.TopLogProbs()
    top = list(row.top)[:num]
    return vllm_pb.TopLogProbs(values=[t.logprob for t in top], token_ids=[t.token_id for t in top])


@dataclass
class _Delta:
    ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)


@dataclass
class VllmResponseBuilder:
    """One choice's responses. Invariant: ``output_ids``/``logprobs`` hold everything generated so far."""

    plan: VllmRequestPlan
    index: int
    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    input_logprobs: vllm_pb.InputLogProbs | None = None
    sent_input_logprobs: bool = False

    @property
    def engine_request(self) -> pb.GenerateRequest:
        return self.plan.engine_requests[self.index]

    @property
    def prompt_tokens(self) -> int:
        return len(self.engine_request.prompt_token_ids)

    def add_prompt_logprobs(self, rows: Sequence[pb.TokenLogprob]) -> None:
        if self.plan.num_prompt_logprobs is None:
            return
        prompt = list(self.engine_request.prompt_token_ids)
        entries: list[pb.TokenLogprob | None] = [None, *list(rows)[-(len(prompt) - 1):]] if len(prompt) > 1 else [None]
        self.input_logprobs = vllm_pb.InputLogProbs(
            token_logprobs=[vllm_pb.InputTokenLogProb() if e is None else vllm_pb.InputTokenLogProb(value=e.logprob)
                            for e in entries],
            token_ids=prompt[:len(entries)],
            top_logprobs=[_top(e, self.plan.num_prompt_logprobs) for e in entries])

    def _output_logprobs(self, ids: Sequence[int], rows: Sequence[pb.TokenLogprob]) -> vllm_pb.OutputLogProbs:
        num = self.plan.num_logprobs or 0
        return vllm_pb.OutputLogProbs(token_logprobs=[r.logprob for r in rows], token_ids=list(ids)[:len(rows)],
                                      top_logprobs=[_top(r, num) for r in rows])

    def record(self, delta: _Delta) -> None:
        self.output_ids.extend(delta.ids)
        self.logprobs.extend(delta.logprobs[:len(delta.ids)])

    def chunk(self, delta: _Delta) -> vllm_pb.GenerateResponse:
        chunk = vllm_pb.GenerateStreamChunk(token_ids=delta.ids, prompt_tokens=self.prompt_tokens,
                                            completion_tokens=len(delta.ids), cached_tokens=self.cached_tokens,
                                            index=self.index)
        if self.plan.num_logprobs is not None:
            chunk.output_logprobs.CopyFrom(self._output_logprobs(delta.ids, delta.logprobs))
        if self.input_logprobs is not None and not self.sent_input_logprobs:
            chunk.input_logprobs.CopyFrom(self.input_logprobs)
            self.sent_input_logprobs = True
        return vllm_pb.GenerateResponse(chunk=chunk)

    def complete(self, finish_reason: str, last: _Delta | None, *, matched_token_id: int | None = None,
                 matched_stop_str: str | None = None) -> vllm_pb.GenerateResponse:
        """Streaming: the last delta (the router has accumulated the rest); else everything."""
        ids, rows = (last.ids, last.logprobs) if last is not None else (self.output_ids, self.logprobs)
        done = vllm_pb.GenerateComplete(output_ids=ids, finish_reason=finish_reason, prompt_tokens=self.prompt_tokens,
                                        completion_tokens=len(ids), cached_tokens=self.cached_tokens,
                                        index=self.index)
        if matched_stop_str is not None:
            done.matched_stop_str = matched_stop_str
        elif matched_token_id is not None:
            done.matched_token_id = matched_token_id
        if self.plan.num_logprobs is not None:
            done.output_logprobs.CopyFrom(self._output_logprobs(ids, rows))
        if self.input_logprobs is not None and last is None:
            done.input_logprobs.CopyFrom(self.input_logprobs)
        return vllm_pb.GenerateResponse(complete=done)


class VllmEngineServicer(vllm_grpc.VllmEngineServicer):
    """The vLLM-engine service for one engine (one data-parallel rank, text only). Unimplemented
    RPCs (Embed, profiling, KV events, FlushCache) answer UNIMPLEMENTED."""

    def __init__(self, engine: EngineHandle, *, served_model_name: str, model_path: str, tokenizer_path: str):
        self._engine = engine
        self._served_model_name = served_model_name
        self._model_path = os.path.abspath(model_path)
        self._tokenizer_path = os.path.abspath(tokenizer_path or model_path)
        self._started = time.time()
        self._active: dict[str, list[str]] = {}
        self._last_receive = 0.0
        self._rates = RecentRates()
        self._tokenizer: Tokenizer | None = None
        self._tokenizer_lock = asyncio.Lock()
        self._tokenizer_zip: bytes | None = None

    async def Generate(self, request: vllm_pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[vllm_pb.GenerateResponse]:
        self._last_receive = time.time()
        try:
            info = self._engine.info()
            plan = to_engine_requests(request, info, arrival_time=self._last_receive)
            for choice in plan.engine_requests:
                check_generate_request(choice, info)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self._active[plan.request_id] = [c.request_id for c in plan.engine_requests]
        choices = [self._generate_choice(plan, i) for i in range(len(plan.engine_requests))]
        stream = choices[0] if len(choices) == 1 else merge_streams(choices)
        try:
            async with contextlib.aclosing(stream) as responses:
                async for response in responses:
                    yield response
        except _EngineFailure as failure:
            await context.abort(failure.code, failure.message)
        finally:
            self._active.pop(plan.request_id, None)

    async def _generate_choice(self, plan: VllmRequestPlan, index: int) -> AsyncIterator[vllm_pb.GenerateResponse]:
        builder = VllmResponseBuilder(plan, index)
        watcher = await self._stop_watcher(plan, builder.engine_request)
        held: _Delta | None = None  # streaming: the newest delta, sent once it is known not to be the last
        try:
            async with contextlib.aclosing(self._engine.generate(builder.engine_request)) as events:
                async for event in events:
                    kind = event.WhichOneof("event")
                    if kind == "scheduled":
                        builder.cached_tokens = event.scheduled.cached_tokens
                    elif kind == "tokens":
                        if event.tokens.prompt_logprobs and builder.input_logprobs is None:
                            builder.add_prompt_logprobs(event.tokens.prompt_logprobs)
                        ids, matched = (watcher.push(event.tokens.ids) if watcher is not None
                                        else (list(event.tokens.ids), None))
                        delta = _Delta(ids, list(event.tokens.logprobs)[:len(ids)])
                        builder.record(delta)
                        self._rates.record_tokens(len(ids))
                        if plan.stream:
                            if held is not None:
                                yield builder.chunk(held)
                            held = delta
                        if matched is not None:
                            for response in self._finish(builder, "stop", held, matched_stop_str=matched):
                                yield response
                            return
                    elif kind == "finished":
                        finished = event.finished
                        if finished.reason == pb.FINISH_REASON_ERROR:
                            raise _EngineFailure(grpc.StatusCode.INTERNAL, f"the engine failed request "
                                                 f"{builder.engine_request.request_id!r}; see the worker's log")
                        builder.cached_tokens = max(builder.cached_tokens, finished.cached_tokens)
                        matched_id = (finished.matched_stop_token_id if finished.HasField("matched_stop_token_id")
                                      and finished.matched_stop_token_id in plan.stop_token_ids else None)
                        self._rates.record_prompt(builder.prompt_tokens, builder.cached_tokens)
                        for response in self._finish(builder, FINISH_REASONS.get(finished.reason, "stop"), held,
                                                     matched_token_id=matched_id):
                            yield response
                        return
                    elif kind == "error":
                        raise _EngineFailure(_ENGINE_ERROR_STATUS.get(event.error.code, grpc.StatusCode.INTERNAL),
                                             event.error.message)
        except InvalidRequestError as exc:
            raise _EngineFailure(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        except QueueFullError as exc:
            raise _EngineFailure(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from exc
        except EngineDeadError as exc:
            raise _EngineFailure(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc
        raise _EngineFailure(grpc.StatusCode.INTERNAL, f"the engine ended request "
                             f"{builder.engine_request.request_id!r} without a finished event")

    @staticmethod
    def _finish(builder: VllmResponseBuilder, reason: str, held: _Delta | None,
                **matched: object) -> list[vllm_pb.GenerateResponse]:
        if not builder.plan.stream:
            return [builder.complete(reason, None, **matched)]
        last = held or _Delta()
        return [builder.chunk(last), builder.complete(reason, last, **matched)]

    async def _stop_watcher(self, plan: VllmRequestPlan, choice: pb.GenerateRequest) -> StopStringWatcher | None:
        if not plan.stop_strings:
            return None
        async with self._tokenizer_lock:
            if self._tokenizer is None:
                try:
                    self._tokenizer = await asyncio.to_thread(Tokenizer.from_dir, self._tokenizer_path)
                except (OSError, ValueError):
                    return None  # the router still trims the text
        return StopStringWatcher(self._tokenizer, choice.prompt_token_ids, plan.stop_strings,
                                 plan.skip_special_tokens, choice.stop.min_tokens)

    async def Abort(self, request: vllm_pb.AbortRequest, context: grpc.aio.ServicerContext) -> vllm_pb.AbortResponse:
        for request_id in request.request_ids:
            for engine_request_id in self._active.get(request_id, [request_id]):
                await self._engine.abort(engine_request_id)
        return vllm_pb.AbortResponse()

    async def HealthCheck(self, request: vllm_pb.HealthCheckRequest,
                          context: grpc.aio.ServicerContext) -> vllm_pb.HealthCheckResponse:
        health = self._engine.health()
        return vllm_pb.HealthCheckResponse(healthy=health.healthy, message=health.message or
                                           ("healthy" if health.healthy else "the engine is not healthy"))

    async def GetModelInfo(self, request: vllm_pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> vllm_pb.GetModelInfoResponse:
        info = self._engine.info()
        return vllm_pb.GetModelInfoResponse(
            model_path=self._model_path, is_generation=True, max_context_length=info.max_model_len,
            vocab_size=info.vocab_size, supports_vision=False, served_model_name=self._served_model_name,
            tokenizer_path=self._tokenizer_path, model_type=info.model_type, architectures=list(info.architectures),
            eos_token_ids=list(info.eos_token_ids),
            bos_token_id=info.bos_token_id if info.HasField("bos_token_id") else 0,
            max_req_input_len=max(info.max_model_len - 1, 0))

    async def GetServerInfo(self, request: vllm_pb.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> vllm_pb.GetServerInfoResponse:
        info = self._engine.info()
        return vllm_pb.GetServerInfoResponse(
            active_requests=len(self._active), is_paused=False, last_receive_timestamp=self._last_receive,
            uptime_seconds=time.time() - self._started, server_type="vllm-grpc", data_parallel_size=1,
            block_size=info.kv_block_size, kv_cache_dtype="auto",
            model_dtype="float32" if info.backend == "numpy" else "bfloat16",
            # grammars run from the first generated token (no reasoning gate in the engine)
            constrained_decoding_start="first_token")

    async def GetLoads(self, request: vllm_pb.GetLoadsRequest,
                       context: grpc.aio.ServicerContext) -> vllm_pb.GetLoadsResponse:
        info, load = self._engine.info(), self._engine.load()
        total_tokens = load.kv_blocks_total * info.kv_block_size
        used_tokens = load.kv_blocks_used * info.kv_block_size
        scheduler = vllm_pb.SchedulerLoad(
            dp_rank=0, num_running_reqs=load.num_running, num_waiting_reqs=load.num_waiting,
            num_total_reqs=load.num_running + load.num_waiting, num_used_tokens=used_tokens,
            max_total_num_tokens=total_tokens, token_usage=used_tokens / total_tokens if total_tokens else 0.0,
            gen_throughput=self._rates.tokens_per_second(), cache_hit_rate=self._rates.cache_hit_rate(),
            utilization=load.num_running / max(load.max_queue, 1))
        return vllm_pb.GetLoadsResponse(timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                        version="openinfer", dp_rank_count=1, loads=[scheduler])

    async def GetTokenizer(self, request: common_pb2.GetTokenizerRequest,
                           context: grpc.aio.ServicerContext) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        if self._tokenizer_zip is None:
            try:
                self._tokenizer_zip = await asyncio.to_thread(build_tokenizer_zip, self._tokenizer_path)
            except FileNotFoundError as exc:
                await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        for data, digest in iter_bundle_chunks(self._tokenizer_zip):
            yield common_pb2.GetTokenizerChunk(data=data, sha256=digest)


def add_vllm_service(server: grpc.aio.Server, engine: EngineHandle, *, served_model_name: str, model_path: str,
                     tokenizer_path: str) -> None:
    add_servicer(vllm_grpc.add_VllmEngineServicer_to_server,  # undecodable bytes → INVALID_ARGUMENT
                 VllmEngineServicer(engine, served_model_name=served_model_name, model_path=model_path,
                                    tokenizer_path=tokenizer_path), server)
