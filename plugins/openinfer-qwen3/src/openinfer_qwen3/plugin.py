"""The pluggy hooks that make Qwen3 servable: match a config.json, create the engine."""

from __future__ import annotations

from functools import partial
from typing import Any

from openinfer import (
    Backend,
    EngineOptions,
    ModelMemory,
    PagedEngine,
    RankContext,
    create_parallel_model,
    decoder_model_memory,
    hookimpl,
    read_generation_config,
    score_architectures,
)
from openinfer_qwen3.config import ARCHITECTURES, MODEL_TYPES, qwen3_config
from openinfer_qwen3.model import Qwen3ForCausalLM
from openinfer_qwen3.weights import QWEN3_LAYOUT


@hookimpl
def openinfer_match(config: dict[str, Any]) -> int | None:
    return score_architectures(config, ARCHITECTURES, MODEL_TYPES)


@hookimpl
def openinfer_claims() -> list[str]:
    return [*ARCHITECTURES, *MODEL_TYPES]


def load_rank_model(model_path: str, config: dict[str, Any], max_model_len: int | None, backend: Backend,
                    rank: RankContext) -> Qwen3ForCausalLM:
    """One rank's Qwen3 (the whole model when there is one rank); picklable as a partial."""
    return Qwen3ForCausalLM.load(model_path, qwen3_config(config, read_generation_config(model_path)), backend,
                                 max_model_len, rank)


@hookimpl
def openinfer_create_engine(model_path: str, config: dict[str, Any], options: EngineOptions) -> PagedEngine:
    memory = openinfer_model_memory(config)
    model = create_parallel_model(partial(load_rank_model, model_path, config, options.max_model_len), options,
                                  memory, max_model_len=_max_positions(config))
    return PagedEngine(model, options, model_path=model_path, plugin="openinfer-qwen3")


@hookimpl
def openinfer_model_memory(config: dict[str, Any]) -> ModelMemory:
    return decoder_model_memory(qwen3_config(config), QWEN3_LAYOUT)


def _max_positions(config: dict[str, Any]) -> int:
    return int(config.get("max_position_embeddings") or 4096)
