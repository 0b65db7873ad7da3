"""The pluggy hooks that make Llama checkpoints servable: match a config.json, create the engine."""

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
from openinfer_llama.config import ARCHITECTURES, MODEL_TYPES, LlamaConfig
from openinfer_llama.model import LlamaForCausalLM
from openinfer_llama.weights import LLAMA_LAYOUT

PLUGIN_NAME = "openinfer-llama"


# 100 for ``LlamaForCausalLM``; 50 for a config that only says ``model_type: llama``.
openinfer_match, openinfer_claims = name_hooks(ARCHITECTURES, MODEL_TYPES)


def load_rank_model(model_path: str, config: dict[str, Any], max_model_len: int | None, backend: Backend,
                    rank: RankContext) -> LlamaForCausalLM:
    """One rank's Llama (the whole model when there is one rank); picklable as a partial."""
    llama = LlamaConfig.from_dict(config, read_generation_config(model_path))
    return LlamaForCausalLM.load(model_path, llama, backend, max_model_len, rank)


@hookimpl
def openinfer_create_engine(model_path: str, config: dict[str, Any], options: EngineOptions) -> PagedEngine:
    return create_paged_engine(PLUGIN_NAME, model_path, options,
                               partial(load_rank_model, model_path, config, options.max_model_len),
                               openinfer_model_memory(config), max_model_len=_max_positions(config))


@hookimpl
def openinfer_model_memory(config: dict[str, Any]) -> ModelMemory:
    return decoder_model_memory(LlamaConfig.from_dict(config), LLAMA_LAYOUT)


def _max_positions(config: dict[str, Any]) -> int:
    return int(config.get("max_position_embeddings") or 4096)
