"""vLLM-engine requests (what the ``smg`` router sends a ``vllm.grpc.engine.VllmEngine`` worker)
as openinfer ``GenerateRequest``s: one per choice (``n``), plus what the servicer does itself
(streaming, stop strings, which logprobs to return). Fields openinfer cannot honour are refused
with an ``InvalidRequestError`` naming the field, never silently dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb

from openinfer.errors import InvalidRequestError
from openinfer.frontend.grpc.sglang_fanout import fan_out_choices
from openinfer.frontend.validation import default_max_tokens
from openinfer.sampling import MAX_LOGPROBS
from openinfer.v1 import engine_pb2 as pb

MAX_CHOICES = 16
SEED_MODULUS = 2**64


@dataclass(frozen=True)
class VllmRequestPlan:
    """Invariant: ``engine_requests[i]`` is choice ``i``; its id is the router's id when there is
    one choice, else ``f"{request_id}-{i}"``."""

    request_id: str
    engine_requests: tuple[pb.GenerateRequest, ...]
    stream: bool
    stop_strings: tuple[str, ...]
    stop_token_ids: frozenset[int]
    skip_special_tokens: bool
    num_logprobs: int | None  # None: no output logprobs
    num_prompt_logprobs: int | None  # None: no prompt logprobs


def _refuse(field_name: str, what: str) -> InvalidRequestError:
    return InvalidRequestError(f"{field_name}: {what}", field_name)


def _logprob_count(params: vllm_pb.SamplingParams, name: str) -> int | None:
    if not params.HasField(name):
        return None
    value = getattr(params, name)
    if value == -1 or value > MAX_LOGPROBS:  # -1 means the whole vocabulary in vLLM
        raise _refuse(f"sampling_params.{name}", f"at most {MAX_LOGPROBS} logprobs per token, got {value}")
    if value < 0:
        raise _refuse(f"sampling_params.{name}", f"must be >= 0, got {value}")
    return value


def structured_output_of(params: vllm_pb.SamplingParams) -> pb.StructuredOutput | None:
    kind = params.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_schema":
        return pb.StructuredOutput(json_schema=params.json_schema)
    if kind == "regex":
        return pb.StructuredOutput(regex=params.regex)
    if kind == "grammar":
        return pb.StructuredOutput(grammar=params.grammar)
    if kind == "json_object":
        return pb.StructuredOutput(json_object=True) if params.json_object else None
    if kind == "choice":
        return pb.StructuredOutput(choice=pb.ChoiceList(choices=list(params.choice.choices)))
    raise _refuse(f"sampling_params.{kind}", "structural tags are not supported; use json_schema, regex, "
                  "grammar, choice or json_object")


def _check_supported(request: vllm_pb.GenerateRequest) -> None:
    if request.WhichOneof("input") != "tokenized":
        raise _refuse("text", "this worker takes tokenized input only (the router tokenizes)")
    if request.HasField("mm_inputs") or len(request.extra_mm_inputs) or request.HasField("media_refs"):
        raise _refuse("mm_inputs", "multimodal inputs are not supported; openinfer serves text-only models")
    if request.HasField("kv_transfer_params") or request.HasField("kv_transfer_params_json"):
        raise _refuse("kv_transfer_params", "prefill/decode disaggregation is not supported")
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        raise _refuse("data_parallel_rank", f"this worker has one data-parallel rank (0), got "
                      f"{request.data_parallel_rank}")
    params = request.sampling_params
    if params.n > MAX_CHOICES:
        raise _refuse("sampling_params.n", f"n={params.n}: at most {MAX_CHOICES} choices per request")
    if params.HasField("truncate_prompt_tokens") and params.truncate_prompt_tokens not in (-1, 0):
        raise _refuse("sampling_params.truncate_prompt_tokens", "prompt truncation is not supported; "
                      "send a prompt that fits")
    # a non-finite or negative value must not fall back to a default below (NaN top_p reading as
    # "unset" would silently sample from the whole vocabulary)
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        value = getattr(params, name)
        if not math.isfinite(value):
            raise _refuse(f"sampling_params.{name}", f"must be a finite number, got {value}")
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        if getattr(params, name) < 0:
            raise _refuse(f"sampling_params.{name}", f"must be >= 0, got {getattr(params, name)}")


def _sampling(params: vllm_pb.SamplingParams) -> pb.SamplingParams:
    """vLLM's sampling params as openinfer's; unset temperature means vLLM's default 1.0."""
    sampling = pb.SamplingParams(
        temperature=params.temperature if params.HasField("temperature") else 1.0,
        top_k=int(params.top_k) if params.top_k > 0 else 0,
        top_p=params.top_p if params.top_p > 0 else 1.0,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty if params.repetition_penalty > 0 else 1.0,
    )
    if params.HasField("seed"):
        sampling.seed = params.seed % SEED_MODULUS
    for token, bias in params.logit_bias.items():
        if token < 0:
            raise _refuse("sampling_params.logit_bias", f"token ids are >= 0, got {token}")
        sampling.logit_bias[token] = bias
    return sampling


def to_engine_requests(request: vllm_pb.GenerateRequest, info: pb.ModelInfo, *,
                      arrival_time: float) -> VllmRequestPlan:
    if not request.request_id:
        raise _refuse("request_id", "is empty; the router must name every request")
    _check_supported(request)
    prompt = list(request.tokenized.input_ids)
    if not prompt:
        raise _refuse("tokenized.input_ids", "is empty")
    params = request.sampling_params
    stop = pb.StopConditions(stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
                             min_tokens=params.min_tokens)
    stop.max_tokens = params.max_tokens if params.HasField("max_tokens") else default_max_tokens(len(prompt), info)
    num_logprobs = _logprob_count(params, "logprobs")
    num_prompt_logprobs = _logprob_count(params, "prompt_logprobs")
    template = pb.GenerateRequest(
        request_id=request.request_id, prompt_token_ids=prompt, sampling=_sampling(params), stop=stop,
        logprobs=max(num_logprobs or 0, num_prompt_logprobs or 0, 1)
        if num_logprobs is not None or num_prompt_logprobs is not None else 0,
        arrival_time=arrival_time, prompt_logprobs=num_prompt_logprobs is not None)
    constraint = structured_output_of(params)
    if constraint is not None:
        template.structured_output.CopyFrom(constraint)
    choices = fan_out_choices(template, max(params.n, 1), seed_modulus=SEED_MODULUS)
    return VllmRequestPlan(
        request_id=request.request_id, engine_requests=tuple(choices), stream=request.stream,
        stop_strings=tuple(s for s in params.stop if s), stop_token_ids=frozenset(params.stop_token_ids),
        skip_special_tokens=params.skip_special_tokens, num_logprobs=num_logprobs,
        num_prompt_logprobs=num_prompt_logprobs)
