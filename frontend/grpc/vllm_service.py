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

import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc

from openinfer.engine import EngineHandle
from openinfer.frontend.grpc.malformed import add_servicer
from openinfer.frontend.grpc.vllm_convert import VllmRequestPlan, to_engine_requests
from openinfer.frontend.grpc.worker_service import (
    FINISH_REASONS,
    ChoiceOf,
    TokenStep,
    WorkerServicer,
)
from openinfer.v1 import engine_pb2 as pb

VLLM_SERVICE = "vllm.grpc.engine.VllmEngine"
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
class VllmResponseBuilder(ChoiceOf):
    """One choice's responses. Invariant: ``output_ids``/``logprobs`` hold everything generated so far."""

    plan: VllmRequestPlan
    index: int
    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    input_logprobs: vllm_pb.InputLogProbs | None = None
    sent_input_logprobs: bool = False

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


class VllmEngineServicer(WorkerServicer, vllm_grpc.VllmEngineServicer):
    """The vLLM-engine service for one engine (one data-parallel rank, text only). Unimplemented
    RPCs (Embed, profiling, KV events, FlushCache) answer UNIMPLEMENTED."""

    def _plan(self, request: vllm_pb.GenerateRequest, info: pb.ModelInfo, arrival_time: float) -> VllmRequestPlan:
        return to_engine_requests(request, info, arrival_time=arrival_time)

    async def _generate_choice(self, plan: VllmRequestPlan, index: int) -> AsyncIterator[vllm_pb.GenerateResponse]:
        builder = VllmResponseBuilder(plan, index)
        held: _Delta | None = None  # streaming: the newest delta, sent once it is known not to be the last
        async with contextlib.aclosing(self._choice_steps(builder)) as steps:
            async for step in steps:
                if isinstance(step, TokenStep):
                    delta = _Delta(step.ids, list(step.logprobs)[:len(step.ids)])
                    builder.record(delta)
                    if plan.stream:
                        if held is not None:
                            yield builder.chunk(held)
                        held = delta
                    if step.matched_stop_str is not None:
                        for response in self._finish(builder, "stop", held, matched_stop_str=step.matched_stop_str):
                            yield response
                        return
                else:
                    matched_id = (step.matched_stop_token_id if step.HasField("matched_stop_token_id")
                                  and step.matched_stop_token_id in plan.stop_token_ids else None)
                    for response in self._finish(builder, FINISH_REASONS.get(step.reason, "stop"), held,
                                                 matched_token_id=matched_id):
                        yield response
                    return

    @staticmethod
    def _finish(builder: VllmResponseBuilder, reason: str, held: _Delta | None,
                **matched: object) -> list[vllm_pb.GenerateResponse]:
        if not builder.plan.stream:
            return [builder.complete(reason, None, **matched)]
        last = held or _Delta()
        return [builder.chunk(last), builder.complete(reason, last, **matched)]

    async def Abort(self, request: vllm_pb.AbortRequest, context: grpc.aio.ServicerContext) -> vllm_pb.AbortResponse:
        for request_id in request.request_ids:
            await self._abort(request_id)
        return vllm_pb.AbortResponse()

    async def HealthCheck(self, request: vllm_pb.HealthCheckRequest,
                          context: grpc.aio.ServicerContext) -> vllm_pb.HealthCheckResponse:
        healthy, message = self._health_message()
        return vllm_pb.HealthCheckResponse(healthy=healthy, message=message)

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

def add_vllm_service(server: grpc.aio.Server, engine: EngineHandle, *, served_model_name: str, model_path: str,
                     tokenizer_path: str) -> None:
    add_servicer(vllm_grpc.add_VllmEngineServicer_to_server,  # undecodable bytes → INVALID_ARGUMENT
                 VllmEngineServicer(engine, served_model_name=served_model_name, model_path=model_path,
                                    tokenizer_path=tokenizer_path), server)
