"""SGLang scheduler requests (what the ``smg`` router sends) as openinfer ``GenerateRequest``s.

``sglang.grpc.scheduler.GenerateRequest`` → :class:`SglangRequestPlan`: one
``openinfer.v1.GenerateRequest`` per choice (``n``) plus what the frontend side must do itself
(stream or not, stop strings, which logprobs to return). Fields openinfer cannot honour are
refused with an ``InvalidRequestError`` that names the field, never silently dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from smg_grpc_proto.generated import sglang_scheduler_pb2 as sglang_pb

from openinfer.errors import InvalidRequestError
from openinfer.frontend.grpc.sglang_fanout import fan_out_choices
from openinfer.frontend.validation import default_max_tokens
from openinfer.v1 import engine_pb2 as pb

# SGLang treats temperatures this small as greedy decoding; openinfer spells greedy as 0.
GREEDY_TEMPERATURE_EPSILON = 1e-5
# Most choices (n) one request may ask for; each is one engine request.
MAX_CHOICES = 16


@dataclass(frozen=True)
class SglangRequestPlan:
    """One router request, split into the engine's part and the frontend's part.

    Invariant: ``engine_requests[i]`` is choice ``i``; its request id is the router's
    ``request_id`` when there is one choice, else ``f"{request_id}-{i}"``.
    """

    request_id: str
    engine_requests: tuple[pb.GenerateRequest, ...]
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
    if params.WhichOneof("constraint") == "structural_tag":
        raise _refuse("sampling_params.structural_tag", "structural tags are not supported; use regex, "
                      "json_schema or ebnf_grammar")
    if params.n > MAX_CHOICES:
        raise _refuse("sampling_params.n", f"n={params.n}: at most {MAX_CHOICES} choices per request; "
                      "send several requests")
    for key in params.logit_bias:
        if not key.strip().isdigit():
            raise _refuse("sampling_params.logit_bias", f"keys are token ids, got {key!r}")
    if params.HasField("custom_params") and len(params.custom_params.fields) > 0:
        raise _refuse("sampling_params.custom_params", "custom sampling params are not supported: "
                      f"{sorted(params.custom_params.fields)}")
    if params.HasField("max_new_tokens") and params.max_new_tokens == 0:
        raise _refuse("sampling_params.max_new_tokens", "max_new_tokens=0 (prefill-only scoring) is "
                      "not supported; ask for at least 1 token")
    if not math.isfinite(params.temperature) or params.temperature < 0:  # NaN would read as greedy
        raise _refuse("sampling_params.temperature", f"must be a finite number >= 0, got {params.temperature}")
    for name in ("top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if not math.isfinite(getattr(params, name)):
            raise _refuse(f"sampling_params.{name}", f"must be a finite number, got {getattr(params, name)}")


def structured_output_of(params: sglang_pb.SamplingParams) -> pb.StructuredOutput | None:
    """SGLang's constraint as the contract's (structural tags were refused before)."""
    kind = params.WhichOneof("constraint")
    if kind == "regex":
        return pb.StructuredOutput(regex=params.regex)
    if kind == "json_schema":
        return pb.StructuredOutput(json_schema=params.json_schema)
    if kind == "ebnf_grammar":
        return pb.StructuredOutput(grammar=params.ebnf_grammar)
    return None


def _sampling(params: sglang_pb.SamplingParams | None) -> pb.SamplingParams:
    """SGLang's sampling params as openinfer's. Absent params mean SGLang's semantic defaults
    (temperature 1.0, no top-k/top-p), not proto3's zeros (which openinfer reads as greedy)."""
    if params is None:
        return pb.SamplingParams(temperature=1.0)
    temperature = params.temperature if params.temperature >= GREEDY_TEMPERATURE_EPSILON else 0.0
    sampling = pb.SamplingParams(
        temperature=temperature,
        top_k=params.top_k if params.top_k > 0 else 0,  # SGLang: -1 disables; openinfer: <= 0
        top_p=params.top_p,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
    )
    sampling.logit_bias.update({int(key): value for key, value in params.logit_bias.items()})
    return sampling


def to_engine_requests(request: sglang_pb.GenerateRequest, info: pb.ModelInfo, *,
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
    template = pb.GenerateRequest(
        request_id=request.request_id,
        prompt_token_ids=prompt,
        sampling=_sampling(params if has_params else None),
        stop=stop,
        logprobs=max(1, top_logprobs_num) if request.return_logprob else 0,
        arrival_time=arrival_time,
        prompt_logprobs=wants_input_logprobs,
    )
    constraint = structured_output_of(params)
    if constraint is not None:
        template.structured_output.CopyFrom(constraint)
    choices = fan_out_choices(template, max(params.n, 1))  # every choice keeps the request's seed
    return SglangRequestPlan(
        request_id=request.request_id,
        engine_requests=tuple(choices),
        stream=request.stream,
        stop_strings=tuple(s for s in params.stop if s),
        skip_special_tokens=params.skip_special_tokens if has_params else True,
        return_logprob=request.return_logprob,
        top_logprobs_num=top_logprobs_num,
        input_logprob_start=request.logprob_start_len if wants_input_logprobs else None,
    )
