"""``create_app``: the OpenAI-compatible FastAPI application over any ``EngineHandle``.

Routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``,
``/tokenize``, ``/detokenize``, and the OpenAPI document ``/openapi.json``. The app never imports
a plugin; it sees the engine only through the ``EngineHandle`` protocol and text only through
``openinfer.tokenizer``.
"""

from __future__ import annotations

import time

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse

from openinfer.engine import EngineHandle
from openinfer.errors import EngineDeadError
from openinfer.frontend.http.body import FastJsonRoute
from openinfer.frontend.http.chat import create_chat_completion, render_chat_prompt
from openinfer.frontend.http.completions import create_completion
from openinfer.frontend.http.context import ServerContext, ServerLimits
from openinfer.frontend.http.errors import error_response, install_error_handlers
from openinfer.frontend.http.fast_lane import CompletionsFastLane, fast_lane_wanted
from openinfer.frontend.http.metrics import FrontendMetrics, ProcessTable
from openinfer.frontend.http.middleware import ApiKeyMiddleware, BodySizeLimitMiddleware, ServerErrorGuard
from openinfer.frontend.http.openapi import (
    BODY_ROUTE_ERRORS,
    OPEN_ROUTE_ERRORS,
    error_responses,
    event_stream_alternative,
    install_openapi,
)
from openinfer.frontend.http.schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    HealthStatus,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from openinfer.tokenizer import Tokenizer
from openinfer.tracing import FrontendTracer, TraceWriter

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
KEYED_ROUTE_ERRORS = (401, 404)  # GET routes behind the key that name a model


def create_app(engine: EngineHandle, tokenizer: Tokenizer, served_model_name: str,
               api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               limits: ServerLimits | None = None, processes: ProcessTable | None = None,
               trace_dir: str | None = None) -> FastAPI:
    """The HTTP server of one served model. ``api_key`` guards every route but /health, /metrics
    and /openapi.json; ``processes`` lists the processes whose memory /metrics reports (default:
    this one); ``trace_dir``: write each request's Chrome trace there (merged with the engine's
    half when the engine traces into the same directory)."""
    app = FastAPI(title="openinfer", version="1", docs_url=None, redoc_url=None, openapi_url="/openapi.json",
                  description="OpenAI-compatible API of one served model. Every error is OpenAI's error "
                              "object; invalid requests are 400 (never 422).")
    app.router.route_class = FastJsonRoute  # msgspec for JSON bodies (a 16k-id prompt: ~1 ms less)
    tracer = FrontendTracer(TraceWriter(trace_dir)) if trace_dir else None
    ctx = ServerContext(engine, tokenizer, served_model_name, FrontendMetrics(engine, served_model_name, processes),
                        limits or ServerLimits(), tracer)
    app.state.openinfer = ctx
    install_error_handlers(app)
    install_openapi(app, served_model_name)
    created = int(time.time())

    def model_card() -> ModelCard:
        # root is the served name, never the model's path on this machine
        return ModelCard(id=served_model_name, created=created, root=served_model_name,
                         max_model_len=engine.info().max_model_len or None)

    @app.post("/v1/completions", response_model=None,
              responses={**event_stream_alternative(CompletionResponse, "The completion (JSON), or its chunks "
                                                    "as server-sent events when `stream` is true"),
                         **error_responses(*BODY_ROUTE_ERRORS)})
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(ctx, body, request)

    @app.post("/v1/chat/completions", response_model=None,
              responses={**event_stream_alternative(ChatCompletionResponse, "The chat completion (JSON), or its "
                                                    "chunks as server-sent events when `stream` is true"),
                         **error_responses(*BODY_ROUTE_ERRORS)})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(ctx, body, request)

    @app.get("/v1/models", response_model=ModelList, responses=error_responses(401))
    async def models() -> ModelList:
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=error_responses(*KEYED_ROUTE_ERRORS))
    async def model(model_id: str) -> ModelCard:
        ctx.check_model(model_id)
        return model_card()

    @app.get("/health", response_model=HealthStatus, responses=error_responses(*OPEN_ROUTE_ERRORS))
    async def health() -> Response:
        status = engine.health()
        if status.healthy:
            return JSONResponse({"status": "ok"})
        return error_response(503, f"the engine is unhealthy: {status.message or 'no reason given'}",
                              None, "engine_unhealthy")

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition format",
                              "content": {"text/plain": {"schema": {"type": "string"}}}},
                        **error_responses(*OPEN_ROUTE_ERRORS)})
    async def metrics() -> Response:
        try:
            text = ctx.metrics.render()
        except EngineDeadError as exc:  # a remote engine that cannot be reached has no load to report
            return error_response(503, f"the engine is not reachable: {exc}", None, "engine_unavailable")
        return Response(text, media_type=ctx.metrics.content_type)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=error_responses(*BODY_ROUTE_ERRORS))
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        ctx.check_model(body.model)
        if body.messages is not None:
            ids = await ctx.run_text_work(render_chat_prompt, ctx, body.messages, body.add_generation_prompt)
        else:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await ctx.run_text_work(ctx.encode_prompt, body.prompt or "", add_special)
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=engine.info().max_model_len)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=error_responses(*BODY_ROUTE_ERRORS))
    async def detokenize(body: DetokenizeRequest) -> Response | DetokenizeResponse:
        ctx.check_model(body.model)
        vocab = engine.info().vocab_size or tokenizer.vocab_size
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            return error_response(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens",
                                  "invalid_value")
        return DetokenizeResponse(prompt=await ctx.run_text_work(tokenizer.decode, body.tokens))

    if fast_lane_wanted():  # innermost: inside the size limit, the key check and the guard
        app.add_middleware(CompletionsFastLane, fastapi_app=app, ctx=ctx)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(ServerErrorGuard)  # outermost: nothing below it can end a connection uncleanly
    return app
