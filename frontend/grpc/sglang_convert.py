"""Translate the SGLang scheduler protocol (what the ``smg`` router speaks) to openinfer's contract.

Requests: ``sglang.grpc.scheduler.GenerateRequest`` → :class:`SglangRequestPlan` (an
``openinfer.v1.GenerateRequest`` plus what the frontend side must do itself: stream or not,
stop strings, which logprobs to return). Fields openinfer cannot honour are refused with an
``InvalidRequestError`` that names the field, never silently dropped.

Responses: :class:`SglangResponseBuilder` turns the engine's ``TokenEvent`` stream into
``GenerateResponse`` messages: with ``stream`` one ``chunk`` per token event (token ids and
logprobs incremental, counts cumulative) and then one ``complete``; without ``stream`` only the
``complete``, carrying every output id and the cumulative logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from smg_grpc_proto.generated import sglang_scheduler_pb2 as sglang_pb

from openinfer.errors import InvalidRequestError
from openinfer.frontend.validation import default_max_tokens
from openinfer.v1 import engine_pb2 as pb

# SGLang treats temperatures this small as greedy decoding; openinfer spells greedy as 0.
GREEDY_TEMPERATURE_EPSILON = 1e-5


@dataclass(frozen=True)
class SglangRequestPlan:
    """One router request, split into the engine's part and the frontend's part."""

    engine_request: pb.GenerateRequest
    stream: bool
    stop_strings: tuple[str, ...]
    skip_special_tokens: bool
    return_logprob: bool
    top_logprobs_num: int
    input_logprob_start: int | None  # None: no prompt logprobs; else the first prompt position


def _refuse(field_name: str, what: str) -> InvalidRequestError:
    return InvalidRequestError(f"{field_name}: {what}", field_name)


def _check_supported(request: sglang_pb.GenerateRequest) -> None:
    """Refuse every field openinfer cannot honour, naming the field and what to do instead."""
    if request.HasField("mm_inputs") and request.mm_inputs.ByteSize() > 0:
        raise _refuse("mm_inputs", "multimodal inputs are not supported; openinfer serves text-only "
                      "models, send text messages only")
    if len(request.input_embeds) > 0:
        raise _refuse("input_embeds", "input embeddings are not supported; send token ids")
    if request.lora_id:
        raise _refuse("lora_id", f"LoRA adapters are not supported (got {request.lora_id!r}); "
                      "address the base model without an adapter")
    if request.return_hidden_states:
        raise _refuse("return_hidden_states", "hidden states are not returned by openinfer; "
                      "drop return_hidden_states")
    if request.custom_logit_processor:
        raise _refuse("custom_logit_processor", "custom logit processors are not supported")
    if len(request.token_ids_logprob) > 0:
        raise _refuse("token_ids_logprob", "logprobs of chosen token ids are not supported; use "
                      "top_logprobs_num instead")
    if request.HasField("disaggregated_params") and request.disaggregated_params.bootstrap_host:
        raise _refuse("disaggregated_params", "prefill/decode disaggregation is not supported; run "
                      "the router without --pd-disaggregation")
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        raise _refuse("data_parallel_rank", f"this worker has one data-parallel rank (0), got "
                      f"{request.data_parallel_rank}; run the router without --dp-aware")
    params = request.sampling_params
    constraint = params.WhichOneof("constraint")
    if constraint is not None:
        raise _refuse(f"sampling_params.{constraint}", "structured output (regex, json_schema, "
                      "ebnf_grammar, structural_tag; response_format or tool_choice in the API) is "
                      "not supported by openinfer; drop the constraint")
    if params.n > 1:
        raise _refuse("sampling_params.n", f"n={params.n}: one completion per request is supported; "
                      "send n separate requests")
    if len(params.logit_bias) > 0:
        raise _refuse("sampling_params.logit_bias", "logit_bias is not supported; drop it")
    if params.HasField("custom_params") and len(params.custom_params.fields) > 0:
        raise _refuse("sampling_params.custom_params", "custom sampling params are not supported: "
                      f"{sorted(params.custom_params.fields)}")
    if params.HasField("max_new_tokens") and params.max_new_tokens == 0:
        raise _refuse("sampling_params.max_new_tokens", "max_new_tokens=0 (prefill-only scoring) is "
                      "not supported; ask for at least 1 token")
    if params.temperature < 0:
        raise _refuse("sampling_params.temperature", f"must be >= 0, got {params.temperature}")


def _sampling(params: sglang_pb.SamplingParams | None) -> pb.SamplingParams:
    """SGLang's sampling params as openinfer's. Absent params mean SGLang's semantic defaults
    (temperature 1.0, no top-k/top-p), not proto3's zeros (which openinfer reads as greedy)."""
    if params is None:
        return pb.SamplingParams(temperature=1.0)
    temperature = params.temperature if params.temperature >= GREEDY_TEMPERATURE_EPSILON else 0.0
    return pb.SamplingParams(
        temperature=temperature,
        top_k=params.top_k if params.top_k > 0 else 0,  # SGLang: -1 disables; openinfer: <= 0
        top_p=params.top_p,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
    )


def to_engine_request(request: sglang_pb.GenerateRequest, info: pb.ModelInfo, *,
                      arrival_time: float) -> SglangRequestPlan:
    """The plan for one router request; raises ``InvalidRequestError`` for what openinfer refuses.
    Unset ``max_new_tokens`` (the router leaves it out when the client does) means the rest of
    the model's context, as on openinfer's own HTTP server."""
    if not request.request_id:
        raise _refuse("request_id", "is empty; the router must name every request")
    prompt = list(request.tokenized.input_ids)
    if not prompt:
        raise _refuse("tokenized.input_ids", "is empty; this worker takes tokenized input only "
                      "(the router tokenizes with the model's tokenizer)")
    _check_supported(request)
    has_params = request.HasField("sampling_params")
    params = request.sampling_params
    stop = pb.StopConditions(
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        min_tokens=params.min_new_tokens,
    )
    stop.max_tokens = (params.max_new_tokens if params.HasField("max_new_tokens")
                       else default_max_tokens(len(prompt), info))
    top_logprobs_num = max(0, request.top_logprobs_num) if request.return_logprob else 0
    wants_input_logprobs = request.return_logprob and request.logprob_start_len >= 0
    engine_request = pb.GenerateRequest(
        request_id=request.request_id,
        prompt_token_ids=prompt,
        sampling=_sampling(params if has_params else None),
        stop=stop,
        logprobs=max(1, top_logprobs_num) if request.return_logprob else 0,
        arrival_time=arrival_time,
        prompt_logprobs=wants_input_logprobs,
    )
    return SglangRequestPlan(
        engine_request=engine_request,
        stream=request.stream,
        stop_strings=tuple(s for s in params.stop if s),
        skip_special_tokens=params.skip_special_tokens if has_params else True,
        return_logprob=request.return_logprob,
        top_logprobs_num=top_logprobs_num,
        input_logprob_start=request.logprob_start_len if wants_input_logprobs else None,
    )


FINISH_REASONS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
}


@dataclass
class SglangResponseBuilder:
    """Accumulates one request's output and renders chunk / complete responses.

    Invariant: ``output_ids`` holds every id sent so far (or, without ``stream``, to be sent),
    and ``token_logprobs``/``top_logprobs`` have one entry per id whenever logprobs were asked.
    """

    plan: SglangRequestPlan
    output_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[sglang_pb.TopLogProbs] = field(default_factory=list)
    input_logprobs: sglang_pb.InputLogProbs | None = None

    @property
    def request_id(self) -> str:
        return self.plan.engine_request.request_id

    @property
    def prompt_tokens(self) -> int:
        return len(self.plan.engine_request.prompt_token_ids)

    def add_prompt_logprobs(self, logprobs: Sequence[pb.TokenLogprob]) -> None:
        """Prompt logprobs as SGLang's InputLogProbs: one row per prompt position from
        ``logprob_start_len``; the first prompt token has no logprob (an empty value)."""
        start = self.plan.input_logprob_start
        if start is None or not logprobs:
            return
        prompt = list(self.plan.engine_request.prompt_token_ids)
        rows: list[pb.TokenLogprob | None] = list(logprobs)
        if len(rows) == len(prompt) - 1:
            rows.insert(0, None)
        values, tops = [], []
        for row in rows[start:]:
            values.append(sglang_pb.InputTokenLogProb() if row is None
                          else sglang_pb.InputTokenLogProb(value=row.logprob))
            tops.append(self._top(row))
        self.input_logprobs = sglang_pb.InputLogProbs(
            token_logprobs=values, token_ids=prompt[start:],
            top_logprobs=tops if self.plan.top_logprobs_num > 0 else [])

    def _top(self, row: pb.TokenLogprob | None) -> sglang_pb.TopLogProbs:
        if row is None:
            return sglang_pb.TopLogProbs()
        top = list(row.top)[: self.plan.top_logprobs_num]
        return sglang_pb.TopLogProbs(values=[t.logprob for t in top], token_ids=[t.token_id for t in top])

    def add_tokens(self, ids: Sequence[int], logprobs: Sequence[pb.TokenLogprob]) -> sglang_pb.GenerateResponse:
        """Record new ids; returns the chunk that streams them (send it only with ``stream``)."""
        first_chunk = not self.output_ids
        self.output_ids.extend(ids)
        chunk = sglang_pb.GenerateStreamChunk(
            token_ids=list(ids), prompt_tokens=self.prompt_tokens,
            completion_tokens=len(self.output_ids), cached_tokens=self.cached_tokens)
        if self.plan.return_logprob:
            rows = list(logprobs)[: len(ids)]
            new_values = [row.logprob for row in rows]
            new_tops = [self._top(row) for row in rows] if self.plan.top_logprobs_num > 0 else []
            self.token_logprobs.extend(new_values)
            self.top_logprobs.extend(new_tops)
            chunk.output_logprobs.CopyFrom(sglang_pb.OutputLogProbs(
                token_logprobs=new_values, token_ids=list(ids)[: len(rows)], top_logprobs=new_tops))
        if first_chunk and self.input_logprobs is not None:
            chunk.input_logprobs.CopyFrom(self.input_logprobs)
        return sglang_pb.GenerateResponse(request_id=self.request_id, chunk=chunk)

    def complete(self, finish_reason: str, *, matched_token_id: int | None = None,
                 matched_stop_str: str | None = None) -> sglang_pb.GenerateResponse:
        """The final message: every output id, the finish reason and the cumulative counts."""
        done = sglang_pb.GenerateComplete(
            output_ids=self.output_ids, finish_reason=finish_reason,
            prompt_tokens=self.prompt_tokens, completion_tokens=len(self.output_ids),
            cached_tokens=self.cached_tokens)
        if matched_stop_str is not None:
            done.matched_stop_str = matched_stop_str
        elif matched_token_id is not None:
            done.matched_token_id = matched_token_id
        if self.plan.return_logprob:
            done.output_logprobs.CopyFrom(sglang_pb.OutputLogProbs(
                token_logprobs=self.token_logprobs, token_ids=self.output_ids[: len(self.token_logprobs)],
                top_logprobs=self.top_logprobs))
        if self.input_logprobs is not None:
            done.input_logprobs.CopyFrom(self.input_logprobs)
        return sglang_pb.GenerateResponse(request_id=self.request_id, complete=done)
