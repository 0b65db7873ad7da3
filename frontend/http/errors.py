"""OpenAI's error shape for every failure: ``{"error": {"message", "type", "param", "code"}}``.

Invariant: bad input is always a 4xx in this shape (validation errors are 400, not FastAPI's
422); only a genuine server fault is a 500, and it is still JSON in this shape.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from openinfer.errors import EngineDeadError, InvalidRequestError, QueueFullError

logger = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class OpenAIError(Exception):
    """An error the HTTP layer answers with ``status`` and OpenAI's JSON body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=dict(headers or {}))


def to_openai_error(exc: Exception) -> OpenAIError:
    """Map openinfer's error hierarchy onto HTTP statuses."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return OpenAIError(400, str(exc), exc.field, "invalid_value")
    if isinstance(exc, QueueFullError):
        return OpenAIError(503, str(exc), None, "queue_full", {"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, f"the engine is not running: {exc}", None, "engine_unavailable")
    logger.exception("internal error", exc_info=exc)
    return OpenAIError(500, f"internal server error: {type(exc).__name__}", None, "internal_error")


# pydantic names the member of a union an error came from in ``loc`` ("str", "list[str]",
# "function-after[...]"): not part of the field's path.
_UNION_MEMBER_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "null"})


def _is_path_part(part: object) -> bool:
    if isinstance(part, int):
        return True
    text = str(part)
    return text not in ("body", "query", "path") and text not in _UNION_MEMBER_TAGS and "[" not in text


def _location(loc: tuple) -> str:
    parts = [str(p) for p in loc if _is_path_part(p)]
    return ".".join(parts) if parts else "body"


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    param = _location(tuple(first.get("loc", ())))
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg')}", None
    refused = (first.get("ctx") or {}).get("error")
    if getattr(refused, "field", None):  # a RefusedField names its field itself
        return f"invalid request: {refused}", refused.field
    details = "; ".join(f"{_location(tuple(e.get('loc', ())))}: {e.get('msg')}" for e in errors[:5])
    return f"invalid request: {details}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param, "invalid_value")

    @app.exception_handler(InvalidRequestError)
    @app.exception_handler(QueueFullError)
    @app.exception_handler(EngineDeadError)
    async def _engine(_: Request, exc: Exception) -> JSONResponse:
        error = to_openai_error(exc)
        return error_response(error.status, error.message, error.param, error.code, error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see /v1/models, /v1/completions, " \
                      "/v1/chat/completions, /health, /metrics, /tokenize, /detokenize"
        else:
            message = str(exc.detail) or HTTPStatus(exc.status_code).phrase
        return error_response(exc.status_code, message, None, None, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        error = to_openai_error(exc)
        return error_response(error.status, error.message, error.param, error.code, error.headers)
