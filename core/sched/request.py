"""A request's state as the scheduler and engine see it (token ids only, no text)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from openinfer.sampling import SamplingState
from openinfer.v1 import engine_pb2 as pb


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # never scheduled, or preempted (its KV was freed)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """``token_ids`` = prompt + generated tokens. Tokens ``[0, num_computed_tokens)`` have KV in
    the request's blocks; the rest are computed by coming steps (a chunked prefill, a decode
    step, or a recompute after preemption — one mechanism for all three)."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    stop: pb.StopConditions
    max_tokens: int  # resolved: explicit max_tokens or the rest of the context
    sampling: SamplingState
    num_logprobs: int = 0
    want_logprobs: bool = False
    want_prompt_logprobs: bool = False
    arrival_order: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first scheduling
    status: RequestStatus = RequestStatus.WAITING
    was_scheduled: bool = False
    num_preemptions: int = 0
    prompt_logprobs: list[pb.TokenLogprob] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens
