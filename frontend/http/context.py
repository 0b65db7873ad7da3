"""What every route needs (engine, tokenizer, served name, metrics) and the translation of an
OpenAI request into engine ``GenerateRequest``s, one per choice.

Invariant: every ``GenerateRequest`` built here has passed ``check_generate_request``, has a
unique request id, and, when the client gave a seed, choice ``i`` of a prompt uses ``seed + i``
(so n>1 with a seed gives n different yet reproducible completions).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass
class ServerContext:
    engine: EngineHandle
    tokenizer: Tokenizer
    model_name: str
    metrics: FrontendMetrics
    tracer: FrontendTracer | None = None  # per-request Chrome traces (--trace-dir)

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
    return params


def build_plans(ctx: ServerContext, body: SamplingFields, prompts: Sequence[Sequence[int]],
                max_tokens: int | None, request_id: str, logprobs: int = 0,
                prompt_logprobs: bool = False) -> list[ChoicePlan]:
    """``len(prompts) * body.n`` plans; the choice index of prompt p, sample i is ``p * n + i``."""
    info = ctx.engine.info()
    arrival = time.time()
    plans = []
    for prompt_index, prompt_ids in enumerate(prompts):
        check_prompt(list(prompt_ids), info)
        limit = max_tokens if max_tokens is not None else default_max_tokens(len(prompt_ids), info)
        for sample in range(body.n):
            index = prompt_index * body.n + sample
            request = pb.GenerateRequest(
                request_id=f"{request_id}-{index}",
                prompt_token_ids=list(prompt_ids),
                sampling=sampling_params(body, sample),
                stop=pb.StopConditions(max_tokens=limit, stop_token_ids=body.stop_token_ids or [],
                                       ignore_eos=body.ignore_eos, min_tokens=body.min_tokens),
                logprobs=logprobs,
                arrival_time=arrival,
                prompt_logprobs=prompt_logprobs,
                cache_salt=body.cache_salt or "",
            )
            check_generate_request(request, info)
            plans.append(ChoicePlan(index, request, body.stop_strings(), body.skip_special_tokens))
    return plans


def usage_of(streams: Sequence[ChoiceStream], n: int) -> Usage:
    """Prompt tokens count once per prompt (not once per sample), completion tokens per choice."""
    firsts = [s for s in streams if s.plan.index % n == 0]
    return Usage.of(sum(s.usage.prompt_tokens for s in firsts),
                    sum(s.usage.completion_tokens for s in streams),
                    sum(s.usage.cached_tokens for s in firsts))
