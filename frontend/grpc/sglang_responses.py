"""openinfer ``TokenEvent``s as SGLang scheduler responses (what the ``smg`` router reads).

With ``stream``: one ``chunk`` per token event (ids and logprobs incremental, counts
cumulative), then one ``complete``; without: only the ``complete``, with every output id and the
cumulative logprobs. With ``n`` > 1 every choice does so under its own ``index``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from smg_grpc_proto.generated import sglang_scheduler_pb2 as sglang_pb

from openinfer.frontend.grpc.sglang_convert import SglangRequestPlan
from openinfer.frontend.grpc.worker_service import ChoiceOf
from openinfer.v1 import engine_pb2 as pb


@dataclass
class SglangResponseBuilder(ChoiceOf):
    """Accumulates one choice's output and renders chunk / complete responses.

    Invariant: ``output_ids`` holds every id sent so far (or, without ``stream``, to be sent),
    and ``token_logprobs``/``top_logprobs`` have one entry per id whenever logprobs were asked.
    """

    plan: SglangRequestPlan
    index: int = 0
    output_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[sglang_pb.TopLogProbs] = field(default_factory=list)
    input_logprobs: sglang_pb.InputLogProbs | None = None

    @property
    def request_id(self) -> str:
        """The router's id (responses of every choice carry it; ``index`` tells them apart)."""
        return self.plan.request_id

    def add_prompt_logprobs(self, logprobs: Sequence[pb.TokenLogprob]) -> None:
        """Prompt logprobs as SGLang's InputLogProbs: one row per prompt position from
        ``logprob_start_len``; the first prompt token has no logprob (an empty value)."""
        start = self.plan.input_logprob_start
        if start is None or not logprobs:
            return
        prompt = list(self.engine_request.prompt_token_ids)
        rows: list[pb.TokenLogprob | None] = list(logprobs)
        if len(rows) == len(prompt) - 1:
            rows.insert(0, None)
        values, tops = [], []
        for row in rows[start:]:
            values.append(sglang_pb.InputTokenLogProb() if row is None
                          else sglang_pb.InputTokenLogProb(value=row.logprob))
            tops.append(self._top(row))
        self.input_logprobs = sglang_pb.InputLogProbs(
            token_logprobs=values, token_ids=prompt[start:],
            top_logprobs=tops if self.plan.top_logprobs_num > 0 else [])

    def _top(self, row: pb.TokenLogprob | None) -> sglang_pb.TopLogProbs:
        if row is None:
            return sglang_pb.TopLogProbs()
        top = list(row.top)[: self.plan.top_logprobs_num]
        return sglang_pb.TopLogProbs(values=[t.logprob for t in top], token_ids=[t.token_id for t in top])

    def add_tokens(self, ids: Sequence[int], logprobs: Sequence[pb.TokenLogprob]) -> sglang_pb.GenerateResponse:
        """Record new ids; returns the chunk that streams them (send it only with ``stream``)."""
        first_chunk = not self.output_ids
        self.output_ids.extend(ids)
        chunk = sglang_pb.GenerateStreamChunk(
            token_ids=list(ids), prompt_tokens=self.prompt_tokens,
            completion_tokens=len(self.output_ids), cached_tokens=self.cached_tokens, index=self.index)
        if self.plan.return_logprob:
            rows = list(logprobs)[: len(ids)]
            new_values = [row.logprob for row in rows]
            new_tops = [self._top(row) for row in rows] if self.plan.top_logprobs_num > 0 else []
            self.token_logprobs.extend(new_values)
            self.top_logprobs.extend(new_tops)
            chunk.output_logprobs.CopyFrom(sglang_pb.OutputLogProbs(
                token_logprobs=new_values, token_ids=list(ids)[: len(rows)], top_logprobs=new_tops))
        if first_chunk and self.input_logprobs is not None:
            chunk.input_logprobs.CopyFrom(self.input_logprobs)
        return sglang_pb.GenerateResponse(request_id=self.request_id, chunk=chunk)

    def complete(self, finish_reason: str, *, matched_token_id: int | None = None,
                 matched_stop_str: str | None = None) -> sglang_pb.GenerateResponse:
        """The final message: every output id, the finish reason and the cumulative counts."""
        done = sglang_pb.GenerateComplete(
            output_ids=self.output_ids, finish_reason=finish_reason,
            prompt_tokens=self.prompt_tokens, completion_tokens=len(self.output_ids),
            cached_tokens=self.cached_tokens, index=self.index)
        if matched_stop_str is not None:
            done.matched_stop_str = matched_stop_str
        elif matched_token_id is not None:
            done.matched_token_id = matched_token_id
        if self.plan.return_logprob:
            done.output_logprobs.CopyFrom(sglang_pb.OutputLogProbs(
                token_logprobs=self.token_logprobs, token_ids=self.output_ids[: len(self.token_logprobs)],
                top_logprobs=self.top_logprobs))
        if self.input_logprobs is not None:
            done.input_logprobs.CopyFrom(self.input_logprobs)
        return sglang_pb.GenerateResponse(request_id=self.request_id, complete=done)
