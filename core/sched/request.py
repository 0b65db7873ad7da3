"""A request's state as the scheduler and engine see it (token ids only, no text)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from openinfer.kv.block_pool import PrefixHashes
from openinfer.sampling import SamplingState
from openinfer.v1 import engine_pb2 as pb

# Stands in ``token_ids`` for a token sampled by a step still running on the device; the batch
# builder feeds such inputs from that step's device-side sample ids (async scheduling).
PLACEHOLDER_TOKEN = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # never scheduled, or preempted (its KV was freed)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """``token_ids`` = prompt + generated tokens. Tokens ``[0, num_computed_tokens)`` have KV in
    the request's blocks (or are being computed by a launched step); the rest are computed by
    coming steps (a chunked prefill, a decode step, or a recompute after preemption — one
    mechanism for all three). Generated tokens whose step has not been read back yet are
    ``PLACEHOLDER_TOKEN``; ``pending_sample_row`` is the newest one's row in that step's samples."""

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
    pending_sample_row: int = -1
    cache_salt: str = ""
    # placeholders at the tail of token_ids (tokens sampled by steps not read back yet); a
    # counter, so the resolved length is O(1) instead of a scan of the whole token list
    num_placeholders: int = 0
    # full blocks at the last prefix-cache publish: the engine publishes only when it grows
    num_full_blocks_published: int = -1
    # (the sampling kernel can sample it, sampling needs its history on the host, it does for
    # more than a grammar): fixed for the request's life; set on first use by ``openinfer.runtime.sampler``
    sampling_traits: tuple[bool, bool, bool] | None = None
    # the hashes of its token blocks, computed once (the scheduler's prefix lookups while it
    # waits, its start, every publish and a restart after preemption share them)
    prefix_hashes: PrefixHashes | None = None

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
    def num_resolved_tokens(self) -> int:
        """Tokens before the first placeholder (all of them when none is pending). Placeholders
        are always the tail: they are appended by launches and resolved oldest first."""
        return len(self.token_ids) - self.num_placeholders

    def append_placeholder(self, sample_row: int) -> None:
        """A launched step samples this request's next token (row ``sample_row`` of its samples)."""
        self.token_ids.append(PLACEHOLDER_TOKEN)
        self.num_placeholders += 1
        self.pending_sample_row = sample_row

    def resolve_placeholder(self, index: int, token: int) -> None:
        """The oldest placeholder, at ``index``, was read back as ``token``."""
        self.token_ids[index] = token
        self.num_placeholders -= 1

    def truncate_after(self, index: int) -> None:
        """Drop everything after ``index`` (only placeholders can follow a resolved token)."""
        del self.token_ids[index + 1:]
        self.num_placeholders = 0

    def drop_placeholders(self) -> None:
        """Drop the tokens never read back (a finishing or aborted request)."""
        if self.num_placeholders:
            del self.token_ids[-self.num_placeholders:]
            self.num_placeholders = 0

    @property
    def reached_limit(self) -> bool:
        """No further token may be scheduled: max_tokens generated (placeholders included)."""
        return self.num_output_tokens >= self.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens
