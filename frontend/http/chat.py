"""``POST /v1/chat/completions``: messages rendered with the model's chat template → assistant replies."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence

from starlette.requests import Request

from openinfer.frontend.http.context import ServerContext, build_plans, new_request_id, usage_of
from openinfer.frontend.http.disconnect import until_disconnected
from openinfer.frontend.http.errors import to_openai_error
from openinfer.frontend.http.generation import ChoiceStream, collect_all, merge_deltas, start_choices
from openinfer.frontend.http.schemas import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDeltaChoice,
    ChatLogprobEntry,
    ChatLogprobs,
    ChatMessage,
    ChatMessageOut,
    TopLogprobEntry,
)
from openinfer.frontend.http.sse import DONE_FRAME, EventStreamResponse, sse_frame
from openinfer.tokenizer import Tokenizer
from openinfer.v1 import engine_pb2 as pb


def render_chat_prompt(ctx: ServerContext, messages: Sequence[ChatMessage], add_generation_prompt: bool,
                       tools: list | None = None, template_kwargs: dict | None = None) -> list[int]:
    """Template → text → ids (blocking: run it through ``ctx.run_text_work``). The template writes
    the special tokens itself (bos included, as in Hugging Face), so the text is encoded without
    adding any."""
    text = ctx.tokenizer.apply_chat_template([m.model_dump(exclude_none=True) for m in messages],
                                             add_generation_prompt=add_generation_prompt, tools=tools,
                                             **(template_kwargs or {}))
    return ctx.encode_prompt(text, add_special_tokens=False, field="messages")


def chat_logprobs(tokenizer: Tokenizer, ids: Sequence[int], entries: Sequence[pb.TokenLogprob],
                  num_top: int) -> ChatLogprobs:
    content = []
    for token_id, entry in zip(ids, entries, strict=False):
        top = [TopLogprobEntry(token=tokenizer.token_text(alt.token_id), logprob=alt.logprob,
                               bytes=list(tokenizer.token_bytes(alt.token_id))) for alt in entry.top[:num_top]]
        content.append(ChatLogprobEntry(token=tokenizer.token_text(token_id), logprob=entry.logprob,
                                        bytes=list(tokenizer.token_bytes(token_id)), top_logprobs=top))
    return ChatLogprobs(content=content)


async def create_chat_completion(ctx: ServerContext, body: ChatCompletionRequest, client: Request | None = None):
    """``client`` (the HTTP request) lets a non-streamed reply stop when its client goes away."""
    ctx.check_model(body.model)
    prompt_ids = await ctx.run_text_work(render_chat_prompt, ctx, body.messages, body.add_generation_prompt,
                                         body.tools, body.chat_template_kwargs)
    request_id = new_request_id("chatcmpl")
    num_top = body.top_logprobs or 0
    plans = build_plans(ctx, body, [prompt_ids], body.max_new_tokens(), request_id,
                        logprobs=max(1, num_top) if body.logprobs else 0)
    streams = await start_choices(ctx.engine, ctx.tokenizer, plans, ctx.metrics, ctx.limits.max_queue_wait_s)
    if body.stream:
        return EventStreamResponse(stream_chat(ctx, body, streams, request_id))
    per_choice = await until_disconnected(client, collect_all(streams), streams)
    choices = []
    for stream, deltas in zip(streams, per_choice, strict=True):
        logprobs = None
        if body.logprobs:
            ids = [i for d in deltas for i in d.token_ids]
            entries = [e for d in deltas for e in d.logprobs]
            logprobs = chat_logprobs(ctx.tokenizer, ids, entries, num_top)
        choices.append(ChatChoice(index=stream.plan.index,
                                  message=ChatMessageOut(content="".join(d.text for d in deltas)),
                                  logprobs=logprobs,
                                  finish_reason=deltas[-1].finish_reason if deltas else None))
    return ChatCompletionResponse(id=request_id, model=ctx.model_name, choices=choices,
                                  usage=usage_of(streams, body.n))


async def stream_chat(ctx: ServerContext, body: ChatCompletionRequest, streams: list[ChoiceStream],
                      request_id: str) -> AsyncIterator[str]:
    created = int(time.time())
    num_top = body.top_logprobs or 0

    def chunk(choices: list[ChatDeltaChoice], usage=None) -> str:
        return sse_frame(ChatCompletionChunk(id=request_id, created=created, model=ctx.model_name,
                                             choices=choices, usage=usage))

    try:
        for stream in streams:  # OpenAI opens every choice with the role
            yield chunk([ChatDeltaChoice(index=stream.plan.index, delta={"role": "assistant", "content": ""})])
        async for delta in merge_deltas(streams):
            logprobs = None
            if body.logprobs and delta.token_ids:
                logprobs = chat_logprobs(ctx.tokenizer, delta.token_ids, delta.logprobs, num_top)
            content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
            yield chunk([ChatDeltaChoice(index=delta.index, delta=content, logprobs=logprobs,
                                         finish_reason=delta.finish_reason)])
        if body.include_usage():
            yield chunk([], usage_of(streams, body.n))
    except Exception as exc:  # the stream has started: report in-band, then end it properly
        yield sse_frame(to_openai_error(exc).body())
    yield DONE_FRAME
