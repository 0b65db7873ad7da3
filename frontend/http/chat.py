"""``POST /v1/chat/completions``: messages rendered with the model's chat template → assistant replies,
split into ``reasoning_content``, ``content`` and ``tool_calls`` (see ``openinfer.frontend.chat_output``)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from openinfer.errors import InvalidRequestError
from openinfer.frontend.chat_output import ChatOutputParser, ParsedDelta
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
from openinfer.frontend.http.structured import constraint_of
from openinfer.frontend.reasoning import THINK_END, starts_in_reasoning, supports_reasoning
from openinfer.frontend.toolcalls import (
    ToolCallFormat,
    ToolChoice,
    detect_format,
    forced_call_constraint,
    resolve_tool_choice,
)
from openinfer.frontend.toolcalls.choice import tool_functions
from openinfer.frontend.toolcalls.qwen_xml import ParameterTypes, parameter_types
from openinfer.structured import after_thought
from openinfer.tokenizer import Tokenizer
from openinfer.v1 import engine_pb2 as pb

# constraints whose output is one value (no thought before it)
VALUE_KINDS = ("json_schema", "json_object", "choice")


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates read them: an assistant's tool-call ``arguments`` (a JSON string
    in the OpenAI API) become objects, so templates can write them in the model's own format."""
    result = []
    for index, message in enumerate(messages):
        data = message.model_dump(exclude_none=True)
        calls = data.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise InvalidRequestError(f"messages[{index}].tool_calls must be a list", "messages")
            parsed_calls = []
            for call in calls:
                function = dict(call.get("function") or {}) if isinstance(call, Mapping) else None
                if function is None or not isinstance(function.get("name"), str):
                    raise InvalidRequestError(f"messages[{index}].tool_calls entries need function.name", "messages")
                arguments = function.get("arguments", "{}")
                if isinstance(arguments, str):
                    try:
                        function["arguments"] = json.loads(arguments or "{}")
                    except json.JSONDecodeError as exc:
                        raise InvalidRequestError(f"messages[{index}].tool_calls: arguments of "
                                                  f"{function['name']!r} are not valid JSON ({exc})", "messages") from exc
                parsed_calls.append({**call, "function": function})
            data["tool_calls"] = parsed_calls
        result.append(data)
    return result


def render_chat_text(tokenizer: Tokenizer, messages: Sequence[ChatMessage], add_generation_prompt: bool,
                     tools: list | None = None, template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The prompt text (``chat_template_kwargs`` were checked against the reserved names when
    the request was validated)."""
    return tokenizer.apply_chat_template(template_messages(messages), add_generation_prompt=add_generation_prompt,
                                         tools=tools, **dict(template_kwargs or {}))


def render_chat_prompt(ctx: ServerContext, messages: Sequence[ChatMessage], add_generation_prompt: bool,
                       tools: list | None = None, template_kwargs: dict | None = None) -> list[int]:
    """Template → text → ids (blocking: run it through ``ctx.run_text_work``). The template writes
    the special tokens itself (bos included, as in Hugging Face), so the text is encoded without
    adding any."""
    text = render_chat_text(ctx.tokenizer, messages, add_generation_prompt, tools, template_kwargs)
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


def prompt_logprobs_table(tokenizer: Tokenizer, prompt_ids: Sequence[int],
                          entries: Sequence[pb.TokenLogprob] | None, num_top: int) -> list[dict | None]:
    """vLLM's prompt_logprobs: None for the first token, then {token id: {logprob, rank, decoded_token}}
    holding the prompt token and the top ``num_top`` alternatives."""
    entries = list(entries or [])[-(len(prompt_ids) - 1):] if len(prompt_ids) > 1 else []
    table: list[dict | None] = [None]
    for token_id, entry in zip(prompt_ids[1:], entries, strict=False):
        ranks = {alt.token_id: rank for rank, alt in enumerate(entry.top, start=1)}
        row = {str(alt.token_id): {"logprob": alt.logprob, "rank": rank,
                                   "decoded_token": tokenizer.token_text(alt.token_id)}
               for rank, alt in enumerate(entry.top[:num_top], start=1)}
        row[str(token_id)] = {"logprob": entry.logprob, "rank": ranks.get(token_id),
                              "decoded_token": tokenizer.token_text(token_id)}
        table.append(row)
    return table


@dataclass
class ChatPlan:
    """What every choice of one chat request shares on the text side."""

    prompt_ids: list[int]
    tool_choice: ToolChoice
    tool_format: ToolCallFormat | None  # parsed out of the output (tool_choice auto)
    model_format: ToolCallFormat | None  # the model's own format, whatever the tool_choice
    reasoning: bool
    in_reasoning: bool
    parameter_types: ParameterTypes

    def parser(self) -> ChatOutputParser:
        return ChatOutputParser(reasoning=self.reasoning, in_reasoning=self.in_reasoning,
                                tool_format=self.tool_format, forced=self.tool_choice, id_format=self.model_format,
                                parameter_types=self.parameter_types)


def plan_chat(ctx: ServerContext, body: ChatCompletionRequest) -> tuple[ChatPlan, pb.StructuredOutput | None]:
    """Blocking (templates, tokenizing, grammar checks): run it through ``ctx.run_text_work``."""
    choice = resolve_tool_choice(body.tools, body.tool_choice)
    constraint = constraint_of(body)
    forced = forced_call_constraint(body.tools or [], choice, body.parallel_tool_calls)
    if forced is not None and constraint is not None:
        raise InvalidRequestError("a forced tool_choice ('required' or a named function) and response_format/"
                                  "structured_outputs cannot be combined; drop one", "tool_choice")
    text = render_chat_text(ctx.tokenizer, body.messages, body.add_generation_prompt, body.tools,
                            body.chat_template_kwargs)
    prompt_ids = ctx.encode_prompt(text, add_special_tokens=False, field="messages")
    model_format = detect_format(ctx.tokenizer, ctx.engine.info().model_type)
    tool_format = model_format if choice.mode == "auto" else None
    reasoning = supports_reasoning(ctx.tokenizer)
    in_thought = reasoning and starts_in_reasoning(text)
    constraint = forced or constraint
    think_end = ctx.tokenizer.raw.token_to_id(THINK_END)
    if constraint is not None and in_thought and think_end is not None:
        # the prompt left the model inside a thought: the thought runs free, the value follows </think>
        constraint = after_thought(constraint, think_end) or constraint
    # a value constrained from the first token has no thought to split off (a regex or grammar
    # may describe the thought itself, so those outputs are still split)
    from_first_token = constraint is not None and constraint.WhichOneof("kind") in VALUE_KINDS
    plan = ChatPlan(prompt_ids, choice, tool_format, model_format, reasoning and not from_first_token,
                    in_thought and not from_first_token, parameter_types(tool_functions(body.tools)))
    return plan, constraint


def message_of(parsed: ParsedDelta, reasoning: bool) -> ChatMessageOut:
    calls = [call.as_openai() for call in parsed.calls()]
    return ChatMessageOut(content=parsed.content if parsed.content or not calls else None,
                          reasoning_content=parsed.reasoning if reasoning and parsed.reasoning else None,
                          tool_calls=calls or None)


def final_reason(reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and reason == "stop" else reason


async def create_chat_completion(ctx: ServerContext, body: ChatCompletionRequest, client: Request | None = None):
    """``client`` (the HTTP request) lets a non-streamed reply stop when its client goes away."""
    ctx.check_model(body.model)
    plan, constraint = await ctx.run_text_work(plan_chat, ctx, body)
    request_id = new_request_id("chatcmpl")
    num_top = body.top_logprobs or 0
    logprobs = max(1, num_top) if body.logprobs else 0
    if body.prompt_logprobs is not None:
        logprobs = max(logprobs, body.prompt_logprobs, 1)
    markers = plan.tool_format is not None or plan.reasoning
    plans = build_plans(ctx, body, [plan.prompt_ids], body.max_new_tokens(), request_id, logprobs=logprobs,
                        prompt_logprobs=body.prompt_logprobs is not None, structured_output=constraint,
                        skip_special_tokens=False if markers else None)
    streams = await start_choices(ctx.engine, ctx.tokenizer, plans, ctx.metrics, ctx.limits.max_queue_wait_s,
                                  ctx.tracer)
    if body.stream:
        return EventStreamResponse(stream_chat(ctx, body, plan, streams, request_id))
    per_choice = await until_disconnected(client, collect_all(streams), streams)
    choices = []
    prompt_table = None
    for stream, deltas in zip(streams, per_choice, strict=True):
        logprobs_out = None
        if body.logprobs:
            ids = [i for d in deltas for i in d.token_ids]
            entries = [e for d in deltas for e in d.logprobs]
            logprobs_out = chat_logprobs(ctx.tokenizer, ids, entries, num_top)
        if body.prompt_logprobs is not None and prompt_table is None:
            entries = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs), None)
            prompt_table = prompt_logprobs_table(ctx.tokenizer, plan.prompt_ids, entries, body.prompt_logprobs)
        parser = plan.parser()
        parsed = ParsedDelta()
        for delta in deltas:
            parsed = parsed.merge(parser.push(delta.text))
        parsed = parsed.merge(parser.finish())
        reason = deltas[-1].finish_reason if deltas else None
        choices.append(ChatChoice(index=stream.plan.index, message=message_of(parsed, plan.reasoning),
                                  logprobs=logprobs_out, finish_reason=final_reason(reason, bool(parsed.tool_calls))))
    return ChatCompletionResponse(id=request_id, model=ctx.model_name, choices=choices,
                                  usage=usage_of(streams, body.n), prompt_logprobs=prompt_table)


def delta_fields(parsed: ParsedDelta) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if parsed.reasoning:
        fields["reasoning_content"] = parsed.reasoning
    if parsed.content:
        fields["content"] = parsed.content
    if parsed.tool_calls:  # OpenAI's pieces: the first of a call names it, the others add arguments
        fields["tool_calls"] = [call.as_openai() for call in parsed.tool_calls]
    return fields


async def stream_chat(ctx: ServerContext, body: ChatCompletionRequest, plan: ChatPlan, streams: list[ChoiceStream],
                      request_id: str) -> AsyncIterator[str]:
    created = int(time.time())
    num_top = body.top_logprobs or 0
    parsers = {stream.plan.index: plan.parser() for stream in streams}
    num_calls = dict.fromkeys(parsers, 0)

    # the chunk's fields as pydantic would write them, rendered once; a plain text delta (no
    # logprobs, no usage) is then one dict copy + json.dumps instead of a pydantic model per token
    frame = ChatCompletionChunk(id=request_id, created=created, model=ctx.model_name, choices=[]).model_dump(
        mode="json")

    def chunk(choices: list[ChatDeltaChoice], usage=None) -> str:
        if usage is None and len(choices) == 1 and choices[0].logprobs is None and all(
                isinstance(v, str) for v in choices[0].delta.values()):
            choice = choices[0]
            return "data: " + json.dumps({**frame, "choices": [{
                "index": choice.index, "delta": choice.delta, "logprobs": None,
                "finish_reason": choice.finish_reason}]}, ensure_ascii=False, separators=(",", ":")) + "\n\n"
        return sse_frame(ChatCompletionChunk(id=request_id, created=created, model=ctx.model_name,
                                             choices=choices, usage=usage))

    def parse(delta: ChoiceDelta) -> ParsedDelta:
        parser = parsers[delta.index]
        parsed = parser.push(delta.text)
        if delta.finish_reason is not None:
            parsed = parsed.merge(parser.finish())
        return parsed

    try:
        for stream in streams:  # OpenAI opens every choice with the role
            yield chunk([ChatDeltaChoice(index=stream.plan.index, delta={"role": "assistant", "content": ""})])
        async for delta in merge_deltas(streams):
            logprobs = None
            if body.logprobs and delta.token_ids:
                logprobs = chat_logprobs(ctx.tokenizer, delta.token_ids, delta.logprobs, num_top)
            parsed = parse(delta)
            fields = delta_fields(parsed)
            num_calls[delta.index] += sum(call.opens_call for call in parsed.tool_calls)
            reason = final_reason(delta.finish_reason, num_calls[delta.index] > 0)
            if fields or logprobs is not None or reason is not None:
                yield chunk([ChatDeltaChoice(index=delta.index, delta=fields, logprobs=logprobs,
                                             finish_reason=reason)])
        if body.include_usage():
            yield chunk([], usage_of(streams, body.n))
    except Exception as exc:  # the stream has started: report in-band, then end it properly
        yield sse_frame(to_openai_error(exc).body())
    yield DONE_FRAME
