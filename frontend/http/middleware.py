"""ASGI middleware: request-body size limit (413), API-key check (401) and the last-resort
guard that turns an unexpected exception into a 500 in OpenAI's error shape.

All answer in OpenAI's error shape and run before FastAPI parses anything.
"""

from __future__ import annotations

import hmac
import json
import logging

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from openinfer.frontend.http.errors import error_body

logger = logging.getLogger(__name__)

# Paths probes and scrapers reach without an API key.
OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json"})
# Bytes of an oversized body read (and discarded) before answering, so the client can read the 413.
MAX_DRAIN_BYTES = 64 * 1024 * 1024


class BodyTooLargeError(StarletteHTTPException):
    """Raised from ``receive`` when a body without Content-Length grows past the limit."""

    def __init__(self, max_bytes: int):
        super().__init__(413, f"request body is larger than the server's limit of {max_bytes} bytes")


async def send_json(send: Send, status: int, body: dict, headers: list[tuple[bytes, bytes]] = ()) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode()), *headers]})
    await send({"type": "http.response.body", "body": payload})


class BodySizeLimitMiddleware:
    """Invariant: no handler ever sees more than ``max_bytes`` of request body."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._drain(receive)
            message = f"request body of {int(declared)} bytes is larger than the server's limit of " \
                      f"{self.max_bytes} bytes"
            await send_json(send, 413, error_body(413, message, None, "body_too_large"))
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLargeError(self.max_bytes)
            return message

        await self.app(scope, limited_receive, send)

    @staticmethod
    async def _drain(receive: Receive) -> None:
        drained = 0
        while drained < MAX_DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return
            drained += len(message.get("body", b""))
            if not message.get("more_body", False):
                return


class ApiKeyMiddleware:
    """Invariant: with a key configured, every path but ``OPEN_PATHS`` needs ``Authorization: Bearer KEY``."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers", ())).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected):
            await self.app(scope, receive, send)
            return
        message = "missing API key; send 'Authorization: Bearer KEY'" if not given else "invalid API key"
        await send_json(send, 401, error_body(401, message, None, "invalid_api_key"),
                        [(b"www-authenticate", b"Bearer")])


class ServerErrorGuard:
    """Invariant: an exception no handler mapped becomes a 500 in OpenAI's shape *and* ends the
    exchange cleanly, so the keep-alive connection stays usable for the client's next request.
    (Starlette's own last-resort handler sends its 500 and then re-raises, and uvicorn closes
    the connection without saying ``Connection: close``.) If the response had already started,
    nothing can be sent any more: the exception goes on and the server closes the connection."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if started:
                raise
            logger.exception("internal error on %s %s", scope.get("method"), scope.get("path"), exc_info=exc)
            await send_json(send, 500, error_body(500, f"internal server error: {type(exc).__name__}", None,
                                                  "internal_error"))
