"""Driving an engine from a script (benchmarks, notebooks, third-party plugin tests).

Any ``EngineHandle`` works: an in-process engine from ``openinfer.create_engine``, or a client of
a served one. ``generate_request`` builds the contract's request; ``run_requests`` submits many
at once and gathers what each one produced.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from openinfer.v1 import engine_pb2 as pb


@dataclass
class Outcome:
    """Everything one request produced: its tokens, how it ended, and what the cache covered."""

    token_ids: list[int] = field(default_factory=list)
    finish: pb.TokenEvent.Finished | None = None
    error: pb.TokenEvent.Error | None = None
    cached_tokens: int | None = None
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)


_SAMPLING_DEFAULTS = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "presence_penalty": 0.0,
                      "frequency_penalty": 0.0, "repetition_penalty": 1.0}


def generate_request(request_id: str, prompt: Sequence[int], max_tokens: int | None = 16,
                     temperature: float = 0.0, seed: int | None = None, *, ignore_eos: bool = True,
                     stop_token_ids: Sequence[int] = (), min_tokens: int = 0,
                     **fields: Any) -> pb.GenerateRequest:
    """A ``GenerateRequest`` for ``prompt`` token ids (greedy and EOS-ignoring by default, as a
    benchmark wants a fixed output length). Sampling knobs (``top_k``, ``top_p``, ``min_p``,
    the penalties) go to ``SamplingParams``; any other keyword is a ``GenerateRequest`` field."""
    sampling = pb.SamplingParams(temperature=temperature,
                                 **{name: fields.pop(name, default) for name, default in _SAMPLING_DEFAULTS.items()})
    if seed is not None:
        sampling.seed = seed
    stop = pb.StopConditions(stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos, min_tokens=min_tokens)
    if max_tokens is not None:
        stop.max_tokens = max_tokens
    return pb.GenerateRequest(request_id=request_id, prompt_token_ids=list(map(int, prompt)), sampling=sampling,
                              stop=stop, **fields)


async def collect(engine: Any, request: pb.GenerateRequest) -> Outcome:
    """Submit ``request`` and gather its events until it ends."""
    outcome = Outcome()
    async for event in engine.generate(request):
        kind = event.WhichOneof("event")
        if kind == "scheduled":
            outcome.cached_tokens = event.scheduled.cached_tokens
        elif kind == "tokens":
            outcome.token_ids.extend(event.tokens.ids)
            outcome.logprobs.extend(event.tokens.logprobs)
        elif kind == "finished":
            outcome.finish = event.finished
        elif kind == "error":
            outcome.error = event.error
    return outcome


def run_requests(engine: Any, requests: Sequence[pb.GenerateRequest]) -> list[Outcome]:
    """Submit every request at once and wait for all of them (from synchronous code)."""
    async def main() -> list[Outcome]:
        return list(await asyncio.gather(*(collect(engine, r) for r in requests)))

    return asyncio.run(main())
