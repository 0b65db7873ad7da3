"""Checks every frontend applies to a ``GenerateRequest`` before it reaches the engine.

The engine validates too; checking here as well gives HTTP and gRPC clients the same clear
messages (with the model's limits in them) whatever engine sits behind the ``EngineHandle``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from openinfer.errors import InvalidRequestError
from openinfer.sampling import MAX_LOGPROBS, validate_sampling
from openinfer.structured import check_constraint
from openinfer.v1 import engine_pb2 as pb


def check_prompt(prompt_ids: Sequence[int] | np.ndarray, info: pb.ModelInfo, field: str = "prompt") -> None:
    """A prompt (ids, or their array) is non-empty, in the vocabulary, and leaves room for at
    least one new token."""
    if len(prompt_ids) == 0:
        raise InvalidRequestError(f"{field} must not be empty", field)
    vocab = info.vocab_size
    if vocab and max_id(prompt_ids) >= vocab:  # max first: one C-level pass over long prompts
        bad = next(int(t) for t in prompt_ids if t >= vocab)
        raise InvalidRequestError(
            f"{field} has token id {bad} outside the vocabulary (ids must be in [0, {vocab}))", field)
    if info.max_model_len and len(prompt_ids) >= info.max_model_len:
        raise InvalidRequestError(
            f"this model's maximum context length is {info.max_model_len} tokens, but the prompt has "
            f"{len(prompt_ids)} tokens; shorten the prompt to at most {info.max_model_len - 1} tokens", field)


def max_id(prompt_ids: Sequence[int] | np.ndarray) -> int:
    return int(prompt_ids.max()) if isinstance(prompt_ids, np.ndarray) else max(prompt_ids)


def default_max_tokens(num_prompt_tokens: int, info: pb.ModelInfo) -> int:
    """What ``max_tokens`` means when the client leaves it out: the rest of the context."""
    return max(1, (info.max_model_len or num_prompt_tokens + 1) - num_prompt_tokens)


def check_generate_request(request: pb.GenerateRequest, info: pb.ModelInfo, prompt_checked: bool = False,
                           num_prompt_tokens: int | None = None) -> None:
    """Raise ``InvalidRequestError`` naming the field for anything the engine cannot honour.
    ``prompt_checked``: the caller has passed these very prompt ids through ``check_prompt``
    already (a second pass over a 16k-id protobuf field costs ~1 ms); ``num_prompt_tokens``:
    their count, when they travel beside the request (an array) instead of inside it."""
    if not request.request_id:
        raise InvalidRequestError("request_id must not be empty", "request_id")
    if not prompt_checked:
        check_prompt(request.prompt_token_ids, info, "prompt_token_ids")
    validate_sampling(request.sampling)
    stop = request.stop
    num_prompt = len(request.prompt_token_ids) if num_prompt_tokens is None else num_prompt_tokens
    if stop.HasField("max_tokens"):  # unset means "until the context ends"
        if stop.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {stop.max_tokens}", "max_tokens")
        total = num_prompt + stop.max_tokens
        if info.max_model_len and total > info.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {info.max_model_len} tokens, but the request asks for "
                f"{total} tokens ({num_prompt} in the prompt + {stop.max_tokens} max_tokens); "
                f"lower max_tokens to at most {info.max_model_len - num_prompt}", "max_tokens")
    max_tokens = stop.max_tokens if stop.HasField("max_tokens") else default_max_tokens(num_prompt, info)
    if stop.min_tokens > max_tokens:
        raise InvalidRequestError(
            f"min_tokens ({stop.min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens")
    if info.vocab_size:
        bad = [t for t in stop.stop_token_ids if t >= info.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"stop_token_ids has id {bad[0]} outside the vocabulary [0, {info.vocab_size})", "stop_token_ids")
    if info.vocab_size:
        bad_bias = [t for t in request.sampling.logit_bias if t >= info.vocab_size]
        if bad_bias:
            raise InvalidRequestError(
                f"logit_bias names token id {bad_bias[0]}, outside the vocabulary [0, {info.vocab_size})",
                "logit_bias")
    if request.HasField("structured_output"):
        check_constraint(request.structured_output)
    if request.logprobs > MAX_LOGPROBS:
        raise InvalidRequestError(f"logprobs must be at most {MAX_LOGPROBS}, got {request.logprobs}", "logprobs")
