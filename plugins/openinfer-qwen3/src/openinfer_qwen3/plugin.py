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
    create_paged_engine,
    decoder_model_memory,
    hookimpl,
    name_hooks,
    read_generation_config,
)
from openinfer_qwen3.config import ARCHITECTURES, MODEL_TYPES, qwen3_config
from openinfer_qwen3.model import Qwen3ForCausalLM
from openinfer_qwen3.weights import QWEN3_LAYOUT

openinfer_match, openinfer_claims = name_hooks(ARCHITECTURES, MODEL_TYPES)


def load_rank_model(model_path: str, config: dict[str, Any], max_model_len: int | None, backend: Backend,
                    rank: RankContext) -> Qwen3ForCausalLM:
    """One rank's Qwen3 (the whole model when there is one rank); picklable as a partial."""
    return Qwen3ForCausalLM.load(model_path, qwen3_config(config, read_generation_config(model_path)), backend,
                                 max_model_len, rank)


@hookimpl
def openinfer_create_engine(model_path: str, config: dict[str, Any], options: EngineOptions) -> PagedEngine:
    return create_paged_engine("openinfer-qwen3", model_path, options,
                               partial(load_rank_model, model_path, config, options.max_model_len),
                               openinfer_model_memory(config), max_model_len=_max_positions(config))


@hookimpl
def openinfer_model_memory(config: dict[str, Any]) -> ModelMemory:
    return decoder_model_memory(qwen3_config(config), QWEN3_LAYOUT)


def _max_positions(config: dict[str, Any]) -> int:
    return int(config.get("max_position_embeddings") or 4096)
