"""``create_app``: the OpenAI-compatible FastAPI application over any ``EngineHandle``.

Routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``,
``/tokenize``, ``/detokenize``. The app never imports a plugin; it sees the engine only through
the ``EngineHandle`` protocol and text only through ``openinfer.tokenizer``.
"""

from __future__ import annotations

import time

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse

from openinfer.engine import EngineHandle
from openinfer.frontend.http.chat import create_chat_completion, render_chat_prompt
from openinfer.frontend.http.completions import create_completion
from openinfer.frontend.http.context import ServerContext
from openinfer.frontend.http.errors import error_response, install_error_handlers
from openinfer.frontend.http.metrics import FrontendMetrics
from openinfer.frontend.http.middleware import ApiKeyMiddleware, BodySizeLimitMiddleware
from openinfer.frontend.http.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from openinfer.tokenizer import Tokenizer
from openinfer.tracing import FrontendTracer, TraceWriter

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


def create_app(engine: EngineHandle, tokenizer: Tokenizer, served_model_name: str,
               api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               trace_dir: str | None = None) -> FastAPI:
    """The HTTP server of one served model. ``api_key`` guards every route but /health and /metrics.
    ``trace_dir``: write each request's Chrome trace there (merged with the engine's half when the
    engine traces into the same directory)."""
    app = FastAPI(title="openinfer", docs_url=None, redoc_url=None, openapi_url=None)
    tracer = FrontendTracer(TraceWriter(trace_dir)) if trace_dir else None
    ctx = ServerContext(engine, tokenizer, served_model_name, FrontendMetrics(engine, served_model_name), tracer)
    app.state.openinfer = ctx
    install_error_handlers(app)
    created = int(time.time())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await create_completion(ctx, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        return await create_chat_completion(ctx, body)

    @app.get("/v1/models")
    async def models() -> dict:
        info = engine.info()
        return {"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": created, "owned_by": "openinfer",
            "root": info.model_path or served_model_name, "parent": None,
            "max_model_len": info.max_model_len}]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        ctx.check_model(model_id)
        return {"id": served_model_name, "object": "model", "created": created, "owned_by": "openinfer"}

    @app.get("/health")
    async def health() -> Response:
        status = engine.health()
        if status.healthy:
            return JSONResponse({"status": "ok"})
        return error_response(503, f"the engine is unhealthy: {status.message or 'no reason given'}",
                              None, "engine_unhealthy")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=ctx.metrics.content_type)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        ctx.check_model(body.model)
        if body.messages is not None:
            ids = render_chat_prompt(tokenizer, body.messages, body.add_generation_prompt)
        else:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = tokenizer.encode(body.prompt or "", add_special_tokens=add_special)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.info().max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        ctx.check_model(body.model)
        vocab = engine.info().vocab_size or tokenizer.vocab_size
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            return error_response(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens",
                                  "invalid_value")
        return {"prompt": tokenizer.decode(body.tokens)}

    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    return app
