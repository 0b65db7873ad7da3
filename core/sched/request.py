"""A request's state as the scheduler and engine see it (token ids only, no text)."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from openinfer.kv.block_pool import PrefixHashes
from openinfer.sampling import SamplingState
from openinfer.v1 import engine_pb2 as pb

# Stands in ``token_ids`` for a token sampled by a step still running on the device; the batch
# builder feeds such inputs from that step's device-side sample ids (async scheduling).
PLACEHOLDER_TOKEN = -1


class TokenIds:
    """A request's token ids: its prompt as the int array it arrived in (never converted to a
    list: for a 16k-token prompt that was ~0.1 ms of its admission, and a prefill chunk's slice
    went into the batch id by id) followed by the generated ids (placeholders included) as a list.

    ::

        index      0 .. num_prompt-1 | num_prompt ..
        storage    prompt (array)    | generated (list)

    Indexing gives an ``int``, slicing an int array; only the generated part changes
    (``append``, item assignment, deleting a tail)."""

    __slots__ = ("prompt", "generated")

    def __init__(self, prompt: np.ndarray | Sequence[int], generated: list[int] | None = None):
        self.prompt = prompt if isinstance(prompt, np.ndarray) else np.asarray(prompt, np.int64).reshape(-1)
        self.generated = [] if generated is None else generated

    def __len__(self) -> int:
        return len(self.prompt) + len(self.generated)

    def __getitem__(self, key: int | slice) -> int | np.ndarray:
        num_prompt = len(self.prompt)
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step == 1 and stop <= num_prompt:
                return self.prompt[start:stop]
            if step == 1 and start >= num_prompt:
                return np.asarray(self.generated[start - num_prompt : stop - num_prompt], np.int64)
            if step == 1:  # across the end of the prompt (a recompute after preemption)
                return np.concatenate((self.prompt[start:], np.asarray(self.generated[: stop - num_prompt], np.int64)))
            return np.asarray(self.tolist()[key], np.int64)
        index = key + len(self) if key < 0 else key
        if 0 <= index < num_prompt:
            return int(self.prompt[index])
        if index < 0:
            raise IndexError(f"token index {key} out of range for {len(self)} tokens")
        return self.generated[index - num_prompt]

    def __setitem__(self, index: int, token: int) -> None:
        index = index + len(self) if index < 0 else index
        if index < len(self.prompt):
            raise IndexError(f"token {index} is part of the prompt, which never changes")
        self.generated[index - len(self.prompt)] = token

    def __delitem__(self, key: slice) -> None:
        """Only a tail of the generated ids can be deleted."""
        start, stop, step = key.indices(len(self)) if isinstance(key, slice) else (None, None, None)
        if step != 1 or stop != len(self) or start < len(self.prompt):
            raise IndexError("only a tail of the generated tokens can be deleted")
        del self.generated[start - len(self.prompt):]

    def append(self, token: int) -> None:
        self.generated.append(token)

    def __iter__(self) -> Iterator[int]:
        return itertools.chain(self.prompt.tolist(), self.generated)

    def tolist(self) -> list[int]:
        return self.prompt.tolist() + self.generated

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenIds):
            other = other.tolist()
        return isinstance(other, Sequence | np.ndarray) and self.tolist() == list(other)

    __hash__ = None  # mutable, compared by value

    def __repr__(self) -> str:
        return f"TokenIds({len(self.prompt)} prompt + {self.generated!r})"


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
    ``PLACEHOLDER_TOKEN``; ``pending_sample_row`` is the newest one's row in that step's samples.
    ``token_ids`` may be given as any sequence of ids (the first ``num_prompt_tokens`` are the
    prompt); it is kept as ``TokenIds``."""

    request_id: str
    token_ids: TokenIds
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

    def __post_init__(self) -> None:
        if not isinstance(self.token_ids, TokenIds):
            ids = self.token_ids
            if isinstance(ids, np.ndarray):
                prompt = ids if len(ids) == self.num_prompt_tokens else ids[: self.num_prompt_tokens]
                self.token_ids = TokenIds(prompt, ids[self.num_prompt_tokens :].tolist())
            else:
                ids = list(ids)
                self.token_ids = TokenIds(ids[: self.num_prompt_tokens], ids[self.num_prompt_tokens :])
        if len(self.token_ids.prompt) != self.num_prompt_tokens:
            raise ValueError(f"{len(self.token_ids.prompt)} prompt ids for num_prompt_tokens={self.num_prompt_tokens}")

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.token_ids.generated)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids.generated)

    @property
    def output_token_ids(self) -> list[int]:
        return list(self.token_ids.generated)

    def token_at(self, position: int) -> int:
        """The id at ``position`` (a placeholder for a token not read back yet)."""
        if position >= self.num_prompt_tokens:
            return self.token_ids.generated[position - self.num_prompt_tokens]
        return int(self.token_ids.prompt[position])

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_resolved_tokens(self) -> int:
        """Tokens before the first placeholder (all of them when none is pending). Placeholders
        are always the tail: they are appended by launches and resolved oldest first."""
        return self.num_tokens - self.num_placeholders

    def append_placeholder(self, sample_row: int) -> None:
        """A launched step samples this request's next token (row ``sample_row`` of its samples)."""
        self.token_ids.generated.append(PLACEHOLDER_TOKEN)
        self.num_placeholders += 1
        self.pending_sample_row = sample_row

    def resolve_placeholder(self, index: int, token: int) -> None:
        """The oldest placeholder, at ``index``, was read back as ``token``."""
        self.token_ids.generated[index - self.num_prompt_tokens] = token
        self.num_placeholders -= 1

    def truncate_after(self, index: int) -> None:
        """Drop everything after ``index`` (only placeholders can follow a resolved token)."""
        del self.token_ids.generated[max(0, index + 1 - self.num_prompt_tokens):]
        self.num_placeholders = 0

    def drop_placeholders(self) -> None:
        """Drop the tokens never read back (a finishing or aborted request)."""
        if self.num_placeholders:
            del self.token_ids.generated[-self.num_placeholders:]
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
