"""Step planning under one token budget (vLLM-v1 style, no prefill/decode phases).

Every step: running requests first (oldest first), each scheduled for as many of its
uncomputed tokens as the budget allows (1 for a decoding request, a chunk of a long prompt);
then waiting requests, first come first served, while budget, sequence slots and KV remain.
When a running request cannot grow its KV, the *newest* running request is preempted: its
blocks are freed and it returns to the front of the waiting queue to be recomputed later from
its tokens so far (its sampler state is kept, so its output is unchanged). The scheduler
plans only; it never touches arrays.

Policies (``policy``, from ``EngineOptions.scheduler_policy`` / ``--scheduler-policy``; default ``mixed``):

* ``mixed`` — the above: decodes ride along with prompt chunks in one step (vLLM v1's policy).
* ``split`` — while some running requests decode and other work is prompt chunks (running or
  waiting), steps alternate: a step of decodes only (one token per sequence: a CUDA-graph
  replay, decode attention kernels) then a step of prompt chunks only, under the whole budget.
  A mixed step runs eagerly and sends its decode rows through the prefill attention kernel
  (one query tile each), which costs more than a separate graphed decode step when many
  requests decode; with only one kind of work, steps are the same as ``mixed``'s.
* ``prefill_first`` — prompt chunks take the budget first; running decodes take what the prompts
  leave (none while prompts fill whole steps; all of them when no prompt can run), placed before
  the chunks in the step. A burst's last first token comes soonest, and so does its end (its
  makespan is the prompt work plus the last request's decode steps), at the price of stalling
  every running request's tokens while prompts fill whole steps (SGLang's default order); a
  trickle of short prompts rides with the decodes as under ``mixed``. Decodes filling a prompt
  step never preempt: one that cannot grow its KV waits for the next step. E1 (H200, Qwen3-4B,
  256 x 1k-in/128-out, with a 16,384-token budget) against ``mixed`` at 8,192: 1.1 % less device
  time (5,123 vs 5,182 ms) but 6,094 vs 6,231 tok/s end to end and TPOT p50 27.2 vs 25.9 ms
  (every stream ends in the same step; the frontend then closes 256 streams at once), so not the
  default.

For models with recurrent state and the prefix cache on, the state at block boundaries
(``kv.hit_granularity``: whole compressed blocks too) is snapshotted so a later request's prefix
hit can start there. A model that writes snapshots inside a step
(``KVCacheGroups.snapshots_within_step``: its forward copies the state after a given row,
``ForwardBatch.state_snapshots``) gets a prompt's last chunk uncut: a prompt runs in one step
(where the forward snapshots: ``KVCacheManager.snapshot_within``'s policy). Prefill chunks cut by
the budget end on a boundary where they can (for every such model: the state after the chunk is
then a snapshot by a copy after the step, and the forward runs no GDN layer in two parts for it);
for models that cannot snapshot inside a step, the last chunk of a prompt also stops at its last
full block first, its last ``len % 16`` tokens then a step of their own.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from openinfer.errors import InvalidRequestError, QueueFullError
from openinfer.kv.manager import KVCacheManager
from openinfer.sched.request import Request, RequestStatus

POLICIES = ("mixed", "split", "prefill_first")
DEFAULT_POLICY = "mixed"


@dataclass
class ScheduledChunk:
    request: Request
    num_tokens: int  # tokens computed this step, starting at request.num_computed_tokens

    @property
    def start(self) -> int:
        return self.request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the request's tokens (so a token is sampled)."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    newly_scheduled: list[Request] = field(default_factory=list)  # first time ever: emit Scheduled

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, max_queue: int, enable_prefix_cache: bool = True,
                 policy: str = DEFAULT_POLICY):
        if policy not in POLICIES:
            raise InvalidRequestError(f"scheduler policy must be one of {POLICIES}, got {policy!r}", field="policy")
        self.policy = policy
        self._decode_turn = True  # split: which kind of step comes next when both are pending
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_queue = max_queue
        self.enable_prefix_cache = enable_prefix_cache
        # recurrent state is only snapshotted at block boundaries: end prefill chunks there (a
        # model that snapshots inside a step: only chunks cut by the budget; a prompt's last runs whole)
        self.align_chunks = enable_prefix_cache and kv.groups.has_state
        self.last_chunk_whole = kv.groups.snapshots_within_step
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # --- admission ---------------------------------------------------------------------------

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Reject at once what can never run: past the context or larger than the whole pool."""
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds the "
                f"model's context of {self.max_model_len} tokens; shorten the prompt or lower max_tokens",
                field="max_tokens" if num_prompt_tokens < self.max_model_len else "prompt")
        short = self.kv.shortfall(total, self.max_num_batched_tokens)
        if short is not None:
            needed, usable = short
            raise InvalidRequestError(
                f"the request needs {needed} KV blocks but the pool holds {usable}; "
                "lower max_tokens or give the engine more KV memory", field="max_tokens")

    def add(self, request: Request) -> None:
        if len(self.waiting) >= self.max_queue:
            raise QueueFullError(self.max_queue)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- planning ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self.policy == "mixed" or not self._both_kinds_pending():
            return self._schedule(decodes=True, prompts=True)
        if self.policy == "prefill_first":
            out = self._schedule(decodes=False, prompts=True)
            if not out.chunks and not out.preempted:
                return self._schedule(decodes=True, prompts=False)
            left = self.max_num_batched_tokens - out.num_tokens
            if left > 0 and not out.preempted:
                fill = self._schedule(decodes=True, prompts=False, budget=left, preempt=False)
                out.chunks[:0] = fill.chunks  # decodes lead the step (attention_routing splits a leading run)
            return out
        decode_turn = self._decode_turn  # split: alternate
        out = self._schedule(decodes=decode_turn, prompts=not decode_turn)
        if not out.chunks and not out.preempted:  # nothing of that kind can run now
            decode_turn = not decode_turn
            out = self._schedule(decodes=decode_turn, prompts=not decode_turn)
        if out.chunks:
            self._decode_turn = not decode_turn
        return out

    def _both_kinds_pending(self) -> bool:
        decoding, prompting = False, bool(self.waiting)
        for request in self.running:
            if request.num_uncomputed_tokens > 1:
                prompting = True
            else:
                decoding = True
            if decoding and prompting:
                return True
        return False

    def _schedule(self, *, decodes: bool, prompts: bool, budget: int | None = None,
                  preempt: bool = True) -> SchedulerOutput:
        """Plan one step; ``decodes`` / ``prompts`` say which running requests may take part
        (decoding: at most one uncomputed token; else a prompt, or tokens to recompute after a
        preemption), and ``prompts`` also whether waiting ones start. ``budget``: tokens to plan
        (default the whole step's); ``preempt`` False: a request whose KV cannot grow ends the
        plan instead of preempting the newest running request."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens if budget is None else budget
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if not (prompts if request.num_uncomputed_tokens > 1 else decodes):
                index += 1
                continue
            num_new = self._chunk_tokens(request, budget)
            if num_new <= 0 or (request.reached_limit and not request.in_prefill):
                # finishing: its last token is still being read back from the device
                index += 1
                continue
            while not self.kv.grow(request.request_id, request.num_computed_tokens + num_new,
                                   request.num_computed_tokens):
                if not preempt:
                    return out
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.chunks.append(ScheduledChunk(request, num_new))
                budget -= num_new
                index += 1
                continue
            break  # the request itself was preempted; nothing after it is left in running

        while prompts and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            request = self.waiting[0]
            started_now = request.request_id not in self.kv.requests
            if started_now and not self.kv.can_start():  # no free state slot
                break
            if started_now:
                use_cache = self.enable_prefix_cache and not request.want_prompt_logprobs
                if use_cache and request.prefix_hashes is None:
                    request.prefix_hashes = self.kv.prefix_hashes(request.cache_salt)
                cached = self.kv.start_request(request.request_id, request.token_ids, use_cache,
                                               request.cache_salt, request.prefix_hashes)
                request.num_computed_tokens = cached
                if not request.was_scheduled:
                    request.num_cached_tokens = cached
            num_new = self._chunk_tokens(request, budget)
            if not self.kv.grow(request.request_id, request.num_computed_tokens + num_new,
                                request.num_computed_tokens):
                if started_now:
                    self.kv.free_request(request.request_id)
                    request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if not request.was_scheduled:
                request.was_scheduled = True
                out.newly_scheduled.append(request)
            out.chunks.append(ScheduledChunk(request, num_new))
            budget -= num_new
        return out

    def _chunk_tokens(self, request: Request, budget: int) -> int:
        """Tokens to compute for ``request`` this step (see the module docstring on alignment)."""
        num_new = min(request.num_uncomputed_tokens, budget)
        if not self.align_chunks or num_new <= 1:
            return num_new
        start, end, bs = request.num_computed_tokens, request.num_computed_tokens + num_new, self.kv.hit_granularity
        if end < request.num_tokens:  # cut by the budget: at a boundary
            boundary = end // bs * bs
        elif self.last_chunk_whole:  # the forward snapshots inside the step
            return num_new
        else:  # the last chunk: at the last full block before the last token
            boundary = (request.num_tokens - 1) // bs * bs
        return boundary - start if start < boundary < end else num_new

    def _preempt(self, request: Request) -> None:
        self.kv.free_request(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # --- after the step --------------------------------------------------------------------------

    def finish(self, request: Request) -> None:
        """Remove a request (finished, aborted or failed) and return its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        self.kv.free_request(request.request_id)

    def find(self, request_id: str) -> Request | None:
        for request in self.running:
            if request.request_id == request_id:
                return request
        for request in self.waiting:
            if request.request_id == request_id:
                return request
        return None
