"""The default engine: a scheduler thread that plans steps, runs the model, samples, and streams
TokenEvents to asyncio callers."""

from openinfer.runtime.engine import PagedEngine
from openinfer.runtime.model import ModelSpec, PagedModel, RequestStateModel

__all__ = ["ModelSpec", "PagedEngine", "PagedModel", "RequestStateModel"]
