"""A deterministic fake ``EngineHandle`` for frontend tests.

Behaviour (exact, so tests can predict text):

* greedy (temperature 0): generated token k is ``prompt[k % len(prompt)]`` (the model "repeats
  the prompt"); sampled: ids drawn from ``range(sample_low, vocab)`` with a PCG64 seeded by the
  request's seed (a fresh counter when unseeded);
* stops on eos (unless ``ignore_eos``) or a ``stop_token_ids`` id once ``min_tokens`` were made
  (the stop token is reported, as the engine contract allows), else at ``max_tokens``;
* KV accounting: a request holds ``ceil((prompt + generated) / block_size)`` blocks from
  submission until it ends (finished, aborted, or its iterator closed); ``aborted`` lists the
  ids aborted by ``abort`` or by closing the iterator before ``finished``;
* ``max_running`` concurrent requests; one more raises ``QueueFullError``; ``healthy = False``
  makes ``generate`` raise ``EngineDeadError``; ``fail_after = k`` ends requests with an
  ``error`` event after k tokens; ``schedule_delay_s`` holds every request that long in a
  "queue" before its ``scheduled`` event.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from openinfer.errors import EngineDeadError, InvalidRequestError, QueueFullError
from openinfer.sampling import validate_sampling
from openinfer.v1 import engine_pb2 as pb


@dataclass
class _Running:
    request: pb.GenerateRequest
    blocks: int = 0
    aborted: asyncio.Event = field(default_factory=asyncio.Event)


class FakeEngine:
    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int] = (), max_model_len: int = 512,
                 num_kv_blocks: int = 256, block_size: int = 16, token_delay_s: float = 0.0,
                 max_running: int = 64, tokenizer_path: str = "", sample_low: int = 0):
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.max_model_len = max_model_len
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.token_delay_s = token_delay_s
        self.max_running = max_running
        self.tokenizer_path = tokenizer_path
        self.sample_low = sample_low
        self.healthy = True
        self.fail_after: int | None = None  # emit an Error event after this many tokens
        self.schedule_delay_s = 0.0  # time in the "queue" before the scheduled event
        self.running: dict[str, _Running] = {}
        self.submitted: list[pb.GenerateRequest] = []
        self.aborted: list[str] = []
        self._unseeded = itertools.count(1000)
        self.closed = False

    # --- EngineHandle -------------------------------------------------------------------------

    def info(self) -> pb.ModelInfo:
        return pb.ModelInfo(model_id="fake", model_path=self.tokenizer_path, architectures=["FakeForCausalLM"],
                            model_type="fake", vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                            eos_token_ids=self.eos_token_ids, tokenizer_path=self.tokenizer_path,
                            backend="numpy", plugin="fake", kv_block_size=self.block_size,
                            num_kv_blocks=self.num_kv_blocks)

    def health(self) -> pb.HealthResponse:
        return pb.HealthResponse(healthy=self.healthy, message="" if self.healthy else "fake engine marked down")

    def load(self) -> pb.Load:
        return pb.Load(num_running=len(self.running), num_waiting=0, kv_blocks_used=self.blocks_used(),
                       kv_blocks_total=self.num_kv_blocks, max_queue=self.max_running)

    def blocks_used(self) -> int:
        return sum(r.blocks for r in self.running.values())

    async def abort(self, request_id: str) -> bool:
        running = self.running.get(request_id)
        if running is None:
            return False
        self.aborted.append(request_id)
        running.aborted.set()
        return True

    async def close(self) -> None:
        self.closed = True
        for request_id in list(self.running):
            await self.abort(request_id)

    async def generate(self, request: pb.GenerateRequest) -> AsyncIterator[pb.TokenEvent]:
        if not self.healthy:
            raise EngineDeadError("fake engine marked down")
        self._check(request)
        if len(self.running) >= self.max_running:
            raise QueueFullError(self.max_running, retry_after_s=2)
        rid = request.request_id
        state = _Running(request, blocks=self._blocks_for(len(request.prompt_token_ids)))
        self.running[rid] = state
        self.submitted.append(request)
        completed = False
        try:
            if self.schedule_delay_s:
                await asyncio.sleep(self.schedule_delay_s)
            yield pb.TokenEvent(request_id=rid, scheduled=pb.TokenEvent.Scheduled(cached_tokens=0))
            async for event in self._decode(state):
                completed = event.HasField("finished") or event.HasField("error")
                yield event
        finally:
            self.running.pop(rid, None)
            if not completed and rid not in self.aborted:  # iterator closed early: that is an abort
                self.aborted.append(rid)

    # --- internals ----------------------------------------------------------------------------

    def _check(self, request: pb.GenerateRequest) -> None:
        if not request.prompt_token_ids:
            raise InvalidRequestError("prompt_token_ids must not be empty", "prompt_token_ids")
        if max(request.prompt_token_ids) >= self.vocab_size:
            raise InvalidRequestError("prompt token id outside the vocabulary", "prompt_token_ids")
        validate_sampling(request.sampling)
        if request.request_id in self.running:
            raise InvalidRequestError(f"request id {request.request_id!r} is already running", "request_id")

    def _blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def _generator(self, request: pb.GenerateRequest) -> np.random.Generator:
        sampling = request.sampling
        seed = sampling.seed if sampling.HasField("seed") else next(self._unseeded)
        return np.random.Generator(np.random.PCG64(seed))

    def _logprob(self, token: int, num_top: int) -> pb.TokenLogprob:
        value = -0.1 * (token % 7 + 1)
        top = [pb.TopLogprob(token_id=token, logprob=value)]
        top += [pb.TopLogprob(token_id=(token + k) % self.vocab_size, logprob=value - 0.5 * k)
                for k in range(1, num_top)]
        return pb.TokenLogprob(logprob=value, top=top[:num_top])

    async def _decode(self, state: _Running) -> AsyncIterator[pb.TokenEvent]:
        request = state.request
        prompt = list(request.prompt_token_ids)
        greedy = request.sampling.temperature == 0
        rng = None if greedy else self._generator(request)
        stop_ids = set(request.stop.stop_token_ids)
        if not request.stop.ignore_eos:
            stop_ids.update(self.eos_token_ids)
        limit = self.max_model_len - len(prompt)  # unset max_tokens: until the context ends
        if request.stop.HasField("max_tokens"):
            limit = min(request.stop.max_tokens, limit)
        generated = 0
        reason = pb.FINISH_REASON_LENGTH
        matched = None
        while generated < limit:
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            else:
                await asyncio.sleep(0)
            if state.aborted.is_set():
                reason = pb.FINISH_REASON_ABORT
                break
            token = prompt[generated % len(prompt)] if greedy else int(rng.integers(self.sample_low,
                                                                                   self.vocab_size))
            generated += 1
            state.blocks = self._blocks_for(len(prompt) + generated)
            tokens = pb.TokenEvent.Tokens(ids=[token])
            if request.logprobs:
                tokens.logprobs.append(self._logprob(token, request.logprobs))
            if generated == 1 and request.prompt_logprobs:
                tokens.prompt_logprobs.extend(self._logprob(t, request.logprobs) for t in prompt[1:])
            yield pb.TokenEvent(request_id=request.request_id, tokens=tokens)
            if self.fail_after is not None and generated >= self.fail_after:
                error = pb.TokenEvent.Error(code=pb.ERROR_CODE_INTERNAL, message="fake failure")
                yield pb.TokenEvent(request_id=request.request_id, error=error)
                return
            if token in stop_ids and generated > request.stop.min_tokens:
                reason, matched = pb.FINISH_REASON_STOP, token
                break
        finished = pb.TokenEvent.Finished(reason=reason, prompt_tokens=len(prompt), completion_tokens=generated)
        if matched is not None:
            finished.matched_stop_token_id = matched
        yield pb.TokenEvent(request_id=request.request_id, finished=finished)
