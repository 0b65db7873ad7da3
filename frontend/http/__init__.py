"""OpenAI-compatible HTTP server (FastAPI) over any ``EngineHandle``."""

from openinfer.frontend.http.app import create_app

__all__ = ["create_app"]
