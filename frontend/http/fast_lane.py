"""A fast lane for streamed ``POST /v1/completions`` (``OPENINFER_HTTP_FAST_LANE``, default 1; 0
turns it off). D1b (H200, served Qwen3-4B, benchmarks/served_ttft.py, 2 rounds x 7 prompts): warm
TTFT median 0.934x / 1.021x / 0.965x at 1k / 4k / 16k against 0.

A streamed completion is the latency path (TTFT): this ASGI middleware, inside the size limit,
the API-key check and the error guard, reads its body, decodes it (``decode_json_token_ids``),
validates it as a ``CompletionRequest`` and calls the route's handler directly, without FastAPI's
routing and dependency solving (~0.1 ms of a request on the CPU that ran
benchmarks/served_ttft.py). Anything else goes to the app unchanged, its body replayed: another
path or method, a content type that is not JSON, a body that is not valid JSON or not a valid
request (FastAPI then answers it with the same 400 as ever), a request that is not streamed (its
JSON response keeps FastAPI's serialization). An error the handler raises is answered by the
app's own exception handlers, as inside the app.
"""

from __future__ import annotations

import os

from fastapi import FastAPI
from pydantic import ValidationError
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from openinfer.errors import OpenInferError
from openinfer.frontend.http.body import decode_json_token_ids
from openinfer.frontend.http.completions import create_completion
from openinfer.frontend.http.context import ServerContext
from openinfer.frontend.http.schemas import CompletionRequest

FAST_LANE_ENV = "OPENINFER_HTTP_FAST_LANE"
COMPLETIONS_PATH = "/v1/completions"


def fast_lane_wanted() -> bool:
    """``OPENINFER_HTTP_FAST_LANE``: 1 or unset on, 0 off; anything else is an error."""
    value = os.environ.get(FAST_LANE_ENV, "1").strip()
    if value not in ("0", "1"):
        raise OpenInferError(f"{FAST_LANE_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def _is_json(scope: Scope) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == b"application/json"
    return False


class CompletionsFastLane:
    """Invariant: every request it does not answer itself reaches ``app`` exactly as sent (the
    body it read is replayed first), so only a valid streamed completion takes the lane."""

    def __init__(self, app: ASGIApp, fastapi_app: FastAPI, ctx: ServerContext):
        self.app = app
        self.fastapi_app = fastapi_app
        self.ctx = ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") != COMPLETIONS_PATH
                or not _is_json(scope)):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        read: list[Message] = []  # everything received, for the replay
        try:
            while True:
                message = await receive()
                read.append(message)
                if message["type"] != "http.request":
                    break
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
        except Exception as exc:  # e.g. the size limit's 413 (a body without Content-Length)
            await self._answer(exc, Request(scope, receive), scope, receive, send)
            return

        async def replaying_receive() -> Message:
            return read.pop(0) if read else await receive()

        body = None
        if read[-1]["type"] == "http.request":
            try:
                decoded = decode_json_token_ids(b"".join(chunks))
                if isinstance(decoded, dict) and decoded.get("stream") is True:
                    body = CompletionRequest.model_validate(decoded)
            except (ValueError, ValidationError):  # FastAPI answers it (same 400 as ever)
                body = None
        if body is None or not body.stream:
            await self.app(scope, replaying_receive, send)
            return
        read.clear()  # the body is consumed: the handler's receive sees what follows it
        request = Request(scope, replaying_receive)
        try:
            response = await create_completion(self.ctx, body, request)
        except Exception as exc:
            await self._answer(exc, request, scope, replaying_receive, send)
            return
        await response(scope, replaying_receive, send)

    async def _answer(self, exc: Exception, request: Request, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer ``exc`` as the app's exception handlers would; one they leave to the last
        resort is raised to the error guard outside (a 500 in OpenAI's shape)."""
        handlers = self.fastapi_app.exception_handlers
        for cls in type(exc).__mro__:
            if cls is Exception:
                break
            if cls in handlers:
                response = await handlers[cls](request, exc)
                await response(scope, receive, send)
                return
        raise exc
