"""What every route needs (engine, tokenizer, served name, metrics) and the translation of an
OpenAI request into engine ``GenerateRequest``s, one per choice.

Invariant: every ``GenerateRequest`` built here has passed ``check_generate_request``, has a
unique request id, and, when the client gave a seed, choice ``i`` of a prompt uses ``seed + i``
(so n>1 with a seed gives n different yet reproducible completions).
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import numpy as np

from openinfer.engine import EngineHandle
from openinfer.frontend.http.errors import OpenAIError
from openinfer.frontend.http.generation import ChoicePlan, ChoiceStream
from openinfer.frontend.http.metrics import FrontendMetrics
from openinfer.frontend.http.schemas import SamplingFields, Usage
from openinfer.frontend.validation import check_generate_request, check_prompt, default_max_tokens
from openinfer.tokenizer import Tokenizer
from openinfer.tracing import FrontendTracer
from openinfer.v1 import engine_pb2 as pb

SEED_MODULUS = 2**64
DEFAULT_MAX_QUEUE_WAIT_S = 60.0
DEFAULT_TEXT_WORKERS = 4
T = TypeVar("T")


@dataclass(frozen=True)
class ServerLimits:
    """Per-server limits beyond the engine's own (see docs/security.md).

    ``max_queue_wait_s``: a request not scheduled by the engine within this time is aborted and
    answered 503 with Retry-After (None: wait as long as it takes). ``default_max_tokens``: the
    cap on generated tokens when a request gives no max_tokens (None: vLLM's rule alone, the
    model's generation_config ``max_new_tokens`` or else the rest of the context).
    ``text_workers``: tokenizations / chat-template renderings that run at once, in threads, off
    the event loop; more wait their turn without blocking other requests."""

    max_queue_wait_s: float | None = DEFAULT_MAX_QUEUE_WAIT_S
    default_max_tokens: int | None = None
    text_workers: int = DEFAULT_TEXT_WORKERS


@dataclass
class ServerContext:
    engine: EngineHandle
    tokenizer: Tokenizer
    model_name: str
    metrics: FrontendMetrics
    limits: ServerLimits = field(default_factory=ServerLimits)
    tracer: FrontendTracer | None = None  # per-request Chrome traces (--trace-dir)

    def __post_init__(self) -> None:
        self._text_limiter = anyio.CapacityLimiter(max(1, self.limits.text_workers))

    async def run_text_work(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run tokenizer / template work in a worker thread (the tokenizers library releases the
        GIL), at most ``limits.text_workers`` at once, so the event loop keeps serving."""
        return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs),
                                              limiter=self._text_limiter)

    def max_prompt_tokens(self) -> int | None:
        max_len = self.engine.info().max_model_len
        return max_len - 1 if max_len else None

    def encode_prompt(self, text: str, add_special_tokens: bool = True, field: str = "prompt") -> list[int]:
        """Tokenize a prompt, first refusing text too long to fit the context at all (this bounds
        the tokenizer time any one request can take)."""
        limit = self.max_prompt_tokens()
        if limit:
            self.tokenizer.check_length(text, limit, field)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        """max_tokens when the client gives none, as vLLM picks it: the rest of the context, capped
        by the model's generation_config ``max_new_tokens`` and by the server's
        ``--default-max-tokens``."""
        candidates = [default_max_tokens(num_prompt_tokens, self.engine.info()),
                      self.tokenizer.default_max_new_tokens, self.limits.default_max_tokens]
        return max(1, min(c for c in candidates if c))

    def check_model(self, requested: str | None) -> None:
        """An unknown model name is a 404 (as OpenAI answers), an absent one means the served model."""
        if requested and requested != self.model_name:
            raise OpenAIError(404, f"the model {requested!r} does not exist; this server serves "
                                   f"{self.model_name!r} (see GET /v1/models)", "model", "model_not_found")


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sampling_params(body: SamplingFields, choice: int) -> pb.SamplingParams:
    params = pb.SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_k=body.top_k or 0,
        top_p=1.0 if body.top_p is None else body.top_p,
        min_p=body.min_p or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
    )
    if body.seed is not None:
        params.seed = (body.seed + choice) % SEED_MODULUS
    params.logit_bias.update(body.token_bias())
    return params


def prompt_array(prompt_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """A prompt's ids as the read-only int32 array a ``ChoicePlan`` carries (the body's array as it is)."""
    if isinstance(prompt_ids, np.ndarray) and prompt_ids.dtype == np.int32 and not prompt_ids.flags.writeable:
        return prompt_ids
    ids = np.array(prompt_ids, dtype=np.int32)  # ids are TokenIds (schemas): in [0, 2**31)
    ids.flags.writeable = False
    return ids


def build_plans(ctx: ServerContext, body: SamplingFields, prompts: Sequence[Sequence[int] | np.ndarray],
                max_tokens: int | None, request_id: str, logprobs: int = 0,
                prompt_logprobs: bool = False, structured_output: pb.StructuredOutput | None = None,
                skip_special_tokens: bool | None = None) -> list[ChoicePlan]:
    """``len(prompts) * body.n`` plans; the choice index of prompt p, sample i is ``p * n + i``.
    ``skip_special_tokens`` overrides the body's (chat output parsers need the markers)."""
    info = ctx.engine.info()
    arrival = time.time()
    plans = []
    for prompt_index, prompt in enumerate(prompts):
        check_prompt(prompt, info)
        prompt_ids = prompt_array(prompt)
        limit = max_tokens if max_tokens is not None else ctx.default_max_tokens(len(prompt_ids))
        for sample in range(body.n):
            index = prompt_index * body.n + sample
            request = pb.GenerateRequest(  # the prompt travels beside it (ChoicePlan.prompt_ids)
                request_id=f"{request_id}-{index}",
                sampling=sampling_params(body, sample),
                stop=pb.StopConditions(max_tokens=limit, stop_token_ids=body.stop_token_ids or [],
                                       ignore_eos=body.ignore_eos, min_tokens=body.min_tokens),
                logprobs=logprobs,
                arrival_time=arrival,
                prompt_logprobs=prompt_logprobs,
                cache_salt=body.cache_salt or "",
            )
            if structured_output is not None:
                request.structured_output.CopyFrom(structured_output)
            check_generate_request(request, info, prompt_checked=True,  # check_prompt above
                                   num_prompt_tokens=len(prompt_ids))
            skip = body.skip_special_tokens if skip_special_tokens is None else skip_special_tokens
            plans.append(ChoicePlan(index, request, prompt_ids, body.stop_strings(), skip))
    return plans


def usage_of(streams: Sequence[ChoiceStream], n: int) -> Usage:
    """Prompt tokens count once per prompt (not once per sample), completion tokens per choice."""
    firsts = [s for s in streams if s.plan.index % n == 0]
    return Usage.of(sum(s.usage.prompt_tokens for s in firsts),
                    sum(s.usage.completion_tokens for s in streams),
                    sum(s.usage.cached_tokens for s in firsts))
