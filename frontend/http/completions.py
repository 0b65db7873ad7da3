"""``POST /v1/completions``: prompts (text, token ids, or lists of either) → text completions."""

from __future__ import annotations

import codecs
import json
from collections.abc import AsyncIterator, Sequence

import numpy as np
from starlette.requests import Request

from openinfer.frontend.http.context import ServerContext, build_plans, new_request_id, usage_of
from openinfer.frontend.http.disconnect import until_disconnected
from openinfer.frontend.http.errors import to_openai_error
from openinfer.frontend.http.generation import (
    ChoiceDelta,
    ChoiceStream,
    collect_all,
    merge_deltas,
    start_choices,
)
from openinfer.frontend.http.schemas import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    TokenIdArray,
)
from openinfer.frontend.http.sse import DONE_FRAME, EventStreamResponse, sse_frame
from openinfer.frontend.http.structured import constraint_of, may_constrain
from openinfer.tokenizer import Tokenizer
from openinfer.v1 import engine_pb2 as pb


def is_token_ids(prompt: str | list | TokenIdArray) -> bool:
    """A prompt given as token ids only (one list of ints or array, or a list of such lists)."""
    if isinstance(prompt, TokenIdArray):
        return True
    if isinstance(prompt, str) or not prompt:
        return False
    return isinstance(prompt[0], int) or all(not isinstance(p, str) for p in prompt)


def prompt_inputs(ctx: ServerContext, prompt: str | list | TokenIdArray
                  ) -> list[tuple[str | None, Sequence[int] | np.ndarray]]:
    """Every accepted prompt shape as (text if given as text, token ids: a list, or the body's
    int32 array). Blocking: run it through ``ctx.run_text_work``."""
    if isinstance(prompt, TokenIdArray):
        return [(None, prompt.ids)]
    if isinstance(prompt, str):
        return [(prompt, ctx.encode_prompt(prompt))]
    if not prompt or isinstance(prompt[0], int):
        return [(None, list(prompt))]
    return [(p, ctx.encode_prompt(p)) if isinstance(p, str) else (None, list(p)) for p in prompt]


class LogprobsBuilder:
    """Completions' logprobs table, built incrementally. ``text_offset`` counts characters of the
    choice's text from its start: each token's real bytes go through one UTF-8 decoder, so a
    character split over several tokens is counted once, at the token that completes it."""

    def __init__(self, tokenizer: Tokenizer, num_top: int, offset: int = 0):
        self.tokenizer = tokenizer
        self.num_top = num_top
        self.offset = offset
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def build(self, ids: Sequence[int], logprobs: Sequence[pb.TokenLogprob | None]) -> CompletionLogprobs:
        table = CompletionLogprobs()
        for token_id, entry in zip(ids, logprobs, strict=False):
            text = self.tokenizer.token_text(token_id)
            table.tokens.append(text)
            table.text_offset.append(self.offset)
            self.offset += len(self._utf8.decode(self.tokenizer.token_bytes(token_id)))
            if entry is None:
                table.token_logprobs.append(None)
                table.top_logprobs.append(None)
                continue
            table.token_logprobs.append(entry.logprob)
            top = {self.tokenizer.token_text(t.token_id): t.logprob for t in entry.top[:self.num_top]}
            top.setdefault(text, entry.logprob)
            table.top_logprobs.append(top)
        return table


def echo_logprobs(builder: LogprobsBuilder, prompt_ids: Sequence[int],
                  prompt_logprobs: Sequence[pb.TokenLogprob] | None) -> CompletionLogprobs:
    """The prompt's part of the table: the first token has no logprob (nothing precedes it)."""
    entries: list[pb.TokenLogprob | None] = [None]
    if prompt_logprobs:
        entries += list(prompt_logprobs)[-(len(prompt_ids) - 1):] if len(prompt_ids) > 1 else []
    entries += [None] * (len(prompt_ids) - len(entries))
    return builder.build(prompt_ids, entries)


def merge_tables(tables: Sequence[CompletionLogprobs]) -> CompletionLogprobs:
    merged = CompletionLogprobs()
    for table in tables:
        merged.tokens += table.tokens
        merged.token_logprobs += table.token_logprobs
        merged.top_logprobs += table.top_logprobs
        merged.text_offset += table.text_offset
    return merged


async def create_completion(ctx: ServerContext, body: CompletionRequest, client: Request | None = None):
    """``client`` (the HTTP request) lets a non-streamed reply stop when its client goes away."""
    ctx.check_model(body.model)
    # token ids and no constraint: nothing to tokenize or compile, so no worker-thread round trip
    # (two thread hand-overs were ~1 ms of a warm 16k request's TTFT)
    inputs = (prompt_inputs(ctx, body.prompt) if is_token_ids(body.prompt)
              else await ctx.run_text_work(prompt_inputs, ctx, body.prompt))
    constraint = await ctx.run_text_work(constraint_of, body) if may_constrain(body) else None
    want_logprobs = body.logprobs is not None
    request_id = new_request_id("cmpl")
    plans = build_plans(ctx, body, [ids for _, ids in inputs], body.max_tokens, request_id,
                        logprobs=max(1, body.logprobs or 0) if want_logprobs else 0,
                        prompt_logprobs=body.echo and want_logprobs, structured_output=constraint)
    streams = await start_choices(ctx.engine, ctx.tokenizer, plans, ctx.metrics, ctx.limits.max_queue_wait_s,
                                  ctx.tracer)
    # the prompts' text only when it is echoed: decoding a 16k-token prompt costs ~4 ms of CPU
    if body.echo:  # the echo paths read the prompt ids one by one: as ints
        inputs = [(text, ids.tolist() if isinstance(ids, np.ndarray) else ids) for text, ids in inputs]
    echo_texts = (await ctx.run_text_work(lambda: [text if text is not None else ctx.tokenizer.decode(ids)
                                                   for text, ids in inputs]) if body.echo else [])
    if body.stream:
        return EventStreamResponse(stream_completion(ctx, body, streams, request_id, inputs, echo_texts))
    per_choice = await until_disconnected(client, collect_all(streams), streams)
    choices = []
    for stream, deltas in zip(streams, per_choice, strict=True):
        prompt_index = stream.plan.index // body.n
        text = "".join(d.text for d in deltas)
        logprobs = None
        if want_logprobs:
            builder = LogprobsBuilder(ctx.tokenizer, body.logprobs or 0)
            tables = []
            if body.echo:
                prompt_lp = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs), None)
                tables.append(echo_logprobs(builder, inputs[prompt_index][1], prompt_lp))
            tables += [builder.build(d.token_ids, d.logprobs) for d in deltas]
            logprobs = merge_tables(tables)
        if body.echo:
            text = echo_texts[prompt_index] + text
        choices.append(CompletionChoice(index=stream.plan.index, text=text, logprobs=logprobs,
                                        finish_reason=deltas[-1].finish_reason if deltas else None))
    return CompletionResponse(id=request_id, model=ctx.model_name, choices=choices,
                              usage=usage_of(streams, body.n))


async def stream_completion(ctx: ServerContext, body: CompletionRequest, streams: list[ChoiceStream],
                            request_id: str, inputs: list[tuple[str | None, Sequence[int]]],
                            echo_texts: list[str]) -> AsyncIterator[str]:
    want_logprobs = body.logprobs is not None
    builders = {s.plan.index: LogprobsBuilder(ctx.tokenizer, body.logprobs or 0) for s in streams}
    echoed: set[int] = set()

    def chunk(delta: ChoiceDelta) -> CompletionResponse:
        prompt_index = delta.index // body.n
        text, logprobs = delta.text, None
        tables = []
        if body.echo and delta.index not in echoed:
            echoed.add(delta.index)
            text = echo_texts[prompt_index] + text
            if want_logprobs:
                tables.append(echo_logprobs(builders[delta.index], inputs[prompt_index][1],
                                            delta.prompt_logprobs))
        if want_logprobs:
            tables.append(builders[delta.index].build(delta.token_ids, delta.logprobs))
            logprobs = merge_tables(tables)
        return CompletionResponse(id=request_id, model=ctx.model_name, choices=[CompletionChoice(
            index=delta.index, text=text, logprobs=logprobs, finish_reason=delta.finish_reason)])

    first = CompletionResponse(id=request_id, model=ctx.model_name, choices=[])
    # plain text chunks (no logprobs, no echo) are formatted directly: no pydantic per token
    plain = not want_logprobs and not body.echo
    head = (f'data: {{"id":{json.dumps(request_id)},"object":"text_completion","created":{first.created},'
            f'"model":{json.dumps(ctx.model_name, ensure_ascii=False)},"choices":[{{"index":')
    continuous = body.continuous_usage()
    try:
        async for delta in merge_deltas(streams):
            if plain:
                reason = "null" if delta.finish_reason is None else json.dumps(delta.finish_reason)
                usage = usage_of(streams, body.n).model_dump_json() if continuous else "null"
                yield (f'{head}{delta.index},"text":{json.dumps(delta.text, ensure_ascii=False)},"logprobs":null,'
                       f'"finish_reason":{reason}}}],"usage":{usage}}}\n\n')
                continue
            response = chunk(delta)
            response.created = first.created
            if continuous:
                response.usage = usage_of(streams, body.n)
            yield sse_frame(response)
        if body.include_usage():
            yield sse_frame(CompletionResponse(id=request_id, model=ctx.model_name, choices=[],
                                               created=first.created, usage=usage_of(streams, body.n)))
    except Exception as exc:  # the stream has started: report in-band, then end it properly
        yield sse_frame(to_openai_error(exc).body())
    yield DONE_FRAME
