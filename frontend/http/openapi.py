"""The OpenAPI document at /openapi.json, made to say what the server really sends.

FastAPI's generated document differs from the wire in three ways, fixed here: it lists 422 for
invalid bodies (the server answers 400 in OpenAI's error shape, see errors.py), it cannot know
the error statuses routes and middleware produce (401 without the key, 404 unknown model, 413
body too large, 503 queue full or engine down), and a streamed reply is ``text/event-stream``.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from openinfer.frontend.http.schemas import ErrorResponse

ERROR_DESCRIPTIONS = {
    400: "Invalid request (OpenAI error format; `param` names the field)",
    401: "Missing or wrong API key (only when the server has one)",
    404: "Unknown model",
    413: "Request body larger than the server's limit",
    503: "Queue full, queue wait timed out, or the engine is down (Retry-After when retrying helps)",
}
ERROR_SCHEMA_REF = {"$ref": "#/components/schemas/ErrorResponse"}
# statuses each kind of route can answer besides 200
BODY_ROUTE_ERRORS = (400, 401, 404, 413, 503)
OPEN_ROUTE_ERRORS = (503,)  # /health and /metrics: no key, no body


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for a route: each status with the OpenAI error schema."""
    return {status: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[status]} for status in statuses}


def event_stream_alternative(model: type, description: str) -> dict[int | str, dict[str, Any]]:
    """A 200 that is ``model`` as JSON, or server-sent events when the request sets ``stream``."""
    return {200: {"model": model, "description": description,
                  "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


def _only_served_model(schema: dict[str, Any], served_model_name: str) -> None:
    """Request bodies name the model as this server accepts it: its served name, or nothing."""
    for component in schema.get("components", {}).get("schemas", {}).values():
        model = component.get("properties", {}).get("model")
        if model is not None and "Request" in component.get("title", ""):
            model.clear()
            model.update({"anyOf": [{"type": "string", "enum": [served_model_name]}, {"type": "null"}],
                          "title": "Model", "description": "the served model (see GET /v1/models); another "
                                                           "name is answered 404"})


def install_openapi(app: FastAPI, served_model_name: str) -> None:
    """Serve the corrected document (built once) at ``app.openapi_url``."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    responses = operation.get("responses", {})
                    responses.pop("422", None)
                    for status, response in responses.items():
                        if not status.startswith("2"):  # every error is JSON, whatever the route's 200 is
                            response["content"] = {"application/json": {"schema": ERROR_SCHEMA_REF}}
            components = schema.get("components", {}).get("schemas", {})
            components.pop("HTTPValidationError", None)
            components.pop("ValidationError", None)
            _only_served_model(schema, served_model_name)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
