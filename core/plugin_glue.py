"""The glue every model plugin writes the same way, once: the ``openinfer_match`` /
``openinfer_claims`` hooks of a plugin that serves checkpoints by their config.json names, and
the ``openinfer_create_engine`` body that builds one rank's model per rank and wraps it in the
default ``PagedEngine``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from openinfer.hookspecs import hookimpl
from openinfer.options import EngineOptions
from openinfer.parallel.build import create_parallel_model
from openinfer.parallel.memory_plan import ModelMemory
from openinfer.parallel.workers import RankModelFactory
from openinfer.plugins import score_architectures
from openinfer.runtime import PagedEngine

if TYPE_CHECKING:
    from openinfer.backend.base import Backend
    from openinfer.decoder import DecoderConfig, DecoderLayout
    from openinfer.parallel.rank import RankContext


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
    from openinfer.engine_core.startup import deferred_weights, release_host_memory

    # OPENINFER_DEFERRED_WEIGHTS=1: the weights' copies run while the engine compiles its kernels
    with deferred_weights(options) as copies:
        model = create_parallel_model(load_rank, options, memory, max_model_len=max_model_len)
    if copies is None:
        if getattr(model.backend, "name", "") == "cuda":
            # the upload's pinned staging (CuPy caches every block) and the checkpoint's maps: GBs of
            # host memory an idle engine would otherwise keep resident
            release_host_memory()
        return PagedEngine(model, engine_options or options, model_path=model_path, plugin=plugin)
    copies.start()
    engine = PagedEngine(model, engine_options or options, model_path=model_path, plugin=plugin)  # waits for them
    release_host_memory()
    return engine


@dataclass(frozen=True)
class DecoderPlugin:
    """The engine hooks of a plugin whose model is a dense decoder built from one config class::

        DECODER = DecoderPlugin("openinfer-qwen3", qwen3_config, Qwen3ForCausalLM.load, QWEN3_LAYOUT)
        openinfer_create_engine, openinfer_model_memory = DECODER.hooks()

    ``read_config(config_json, generation_config)`` builds the plugin's ``DecoderConfig``;
    ``load(model_path, config, backend, max_model_len, rank)`` one rank's model. Both must be
    module-level (or bound to a class) so ``load_rank_model`` partials pickle to worker processes."""

    plugin: str
    read_config: Callable[..., DecoderConfig]
    load: Callable[..., Any]
    layout: DecoderLayout
    default_max_positions: int = 4096

    def load_rank_model(self, model_path: str, config: dict[str, Any], max_model_len: int | None,
                        backend: Backend, rank: RankContext) -> Any:
        """One rank's model (the whole model when there is one rank); picklable as a partial."""
        from openinfer.plugins import read_generation_config

        decoder = self.read_config(config, read_generation_config(model_path))
        return self.load(model_path, decoder, backend, max_model_len, rank)

    def model_memory(self, config: dict[str, Any]) -> ModelMemory:
        from openinfer.decoder import decoder_model_memory

        return decoder_model_memory(self.read_config(config, None), self.layout)

    def create_engine(self, model_path: str, config: dict[str, Any], options: EngineOptions) -> PagedEngine:
        max_positions = int(config.get("max_position_embeddings") or self.default_max_positions)
        return create_paged_engine(self.plugin, model_path, options,
                                   partial(self.load_rank_model, model_path, config, options.max_model_len),
                                   self.model_memory(config), max_model_len=max_positions)

    def hooks(self) -> tuple[Callable[[str, dict[str, Any], EngineOptions], PagedEngine],
                             Callable[[dict[str, Any]], ModelMemory]]:
        """``openinfer_create_engine`` and ``openinfer_model_memory`` as hook implementations."""

        @hookimpl
        def openinfer_create_engine(model_path: str, config: dict[str, Any], options: EngineOptions) -> PagedEngine:
            return self.create_engine(model_path, config, options)

        @hookimpl
        def openinfer_model_memory(config: dict[str, Any]) -> ModelMemory:
            return self.model_memory(config)

        return openinfer_create_engine, openinfer_model_memory
