"""Checks on a GenerateRequest before it reaches the scheduler; each error names its field."""

from __future__ import annotations

import numpy as np

from openinfer.errors import InvalidRequestError
from openinfer.sampling import MAX_LOGPROBS, validate_sampling
from openinfer.v1 import engine_pb2 as pb


def validate_request(request: pb.GenerateRequest, vocab_size: int, max_model_len: int,
                     prompt: np.ndarray | None = None) -> None:
    """``prompt``: the request's ids as an int array beside it (then its ``prompt_token_ids`` must
    be empty), else its ``prompt_token_ids``."""
    if not request.request_id:
        raise InvalidRequestError("request_id must be a non-empty string", "request_id")
    if prompt is not None and len(request.prompt_token_ids):
        raise InvalidRequestError("the prompt came both beside the request and in prompt_token_ids; send it once",
                                  "prompt_token_ids")
    ids = prompt_ids(request, prompt)
    if len(ids) == 0:
        raise InvalidRequestError("the prompt is empty; send at least one token", "prompt_token_ids")
    if len(ids) >= max_model_len:
        raise InvalidRequestError(
            f"the prompt has {len(ids)} tokens but the model's context is {max_model_len} tokens "
            f"(at most {max_model_len - 1} prompt tokens leave room for one generated token)",
            "prompt_token_ids")
    if ids.max() >= vocab_size or ids.min() < 0:  # (an array beside the request may hold any int32)
        bad = int(ids[np.argmax((ids >= vocab_size) | (ids < 0))])
        raise InvalidRequestError(f"prompt token id {bad} is out of the vocabulary [0, {vocab_size})",
                                  "prompt_token_ids")
    stop = request.stop
    if stop.HasField("max_tokens") and stop.max_tokens < 1:
        raise InvalidRequestError(f"max_tokens must be >= 1, got {stop.max_tokens}", "max_tokens")
    bad_stop = next((t for t in stop.stop_token_ids if t >= vocab_size), None)
    if bad_stop is not None:
        raise InvalidRequestError(f"stop token id {bad_stop} is out of the vocabulary [0, {vocab_size})",
                                  "stop_token_ids")
    bad_bias = next((t for t in request.sampling.logit_bias if t >= vocab_size), None)
    if bad_bias is not None:
        raise InvalidRequestError(f"logit_bias names token id {bad_bias}, outside the vocabulary [0, {vocab_size})",
                                  "logit_bias")
    if request.logprobs > MAX_LOGPROBS:
        raise InvalidRequestError(f"logprobs must be <= {MAX_LOGPROBS}, got {request.logprobs}", "logprobs")
    validate_sampling(request.sampling)


def prompt_ids(request: pb.GenerateRequest, prompt: np.ndarray | None = None) -> np.ndarray:
    """The request's prompt as an int array: ``prompt`` (given beside it) as it is, else its
    ``prompt_token_ids`` (a protobuf repeated field converts without a Python loop)."""
    return np.asarray(request.prompt_token_ids, dtype=np.int64) if prompt is None else prompt


def resolve_max_tokens(request: pb.GenerateRequest, max_model_len: int, num_prompt_tokens: int | None = None) -> int:
    """Explicit max_tokens, else the rest of the context."""
    remaining = max_model_len - (len(request.prompt_token_ids) if num_prompt_tokens is None else num_prompt_tokens)
    if request.stop.HasField("max_tokens"):
        return int(request.stop.max_tokens)
    return remaining
