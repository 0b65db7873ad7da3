"""The glue every model plugin writes the same way, once: the ``openinfer_match`` /
``openinfer_claims`` hooks of a plugin that serves checkpoints by their config.json names, and
the ``openinfer_create_engine`` body that builds one rank's model per rank and wraps it in the
default ``PagedEngine``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from openinfer.hookspecs import hookimpl
from openinfer.options import EngineOptions
from openinfer.parallel.build import create_parallel_model
from openinfer.parallel.memory_plan import ModelMemory
from openinfer.parallel.workers import RankModelFactory
from openinfer.plugins import score_architectures
from openinfer.runtime import PagedEngine


def name_hooks(architectures: tuple[str, ...], model_types: tuple[str, ...]
               ) -> tuple[Callable[[dict[str, Any]], int | None], Callable[[], list[str]]]:
    """``openinfer_match`` (100 when config.json's ``architectures`` names one of ours, 50 when
    only its ``model_type`` does) and ``openinfer_claims`` (all those names) as hook
    implementations; a plugin module binds them under the hook names::

        openinfer_match, openinfer_claims = name_hooks(ARCHITECTURES, MODEL_TYPES)
    """

    @hookimpl
    def openinfer_match(config: dict[str, Any]) -> int | None:
        return score_architectures(config, architectures, model_types)

    @hookimpl
    def openinfer_claims() -> list[str]:
        return [*architectures, *model_types]

    return openinfer_match, openinfer_claims


def create_paged_engine(plugin: str, model_path: str, options: EngineOptions, load_rank: RankModelFactory,
                        memory: ModelMemory | None = None, max_model_len: int = 4096,
                        engine_options: EngineOptions | None = None) -> PagedEngine:
    """The usual ``openinfer_create_engine``: ``load_rank(backend, rank)`` (picklable, e.g. a
    ``functools.partial`` of a module-level function) builds each rank's model through
    ``create_parallel_model`` (``memory`` and ``max_model_len`` feed its memory-plan check on
    GPUs), and the default engine runs it under ``engine_options`` (``options`` when None)."""
    model = create_parallel_model(load_rank, options, memory, max_model_len=max_model_len)
    if getattr(model.backend, "name", "") == "cuda":
        # the upload's pinned staging (CuPy caches every block) and the checkpoint's maps: GBs of
        # host memory an idle engine would otherwise keep resident
        from openinfer.engine_core.startup import release_host_memory

        release_host_memory()
    return PagedEngine(model, engine_options or options, model_path=model_path, plugin=plugin)
