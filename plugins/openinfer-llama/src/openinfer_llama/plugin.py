"""The pluggy hooks that make Llama checkpoints servable: match a config.json, create the engine."""

from __future__ import annotations

from functools import partial
from typing import Any

from openinfer import (
    Backend,
    EngineOptions,
    PagedEngine,
    RankContext,
    create_parallel_model,
    hookimpl,
    read_generation_config,
    score_architectures,
)
from openinfer_llama.config import ARCHITECTURES, MODEL_TYPES, LlamaConfig
from openinfer_llama.model import LlamaForCausalLM

PLUGIN_NAME = "openinfer-llama"


@hookimpl
def openinfer_match(config: dict[str, Any]) -> int | None:
    """100 for ``LlamaForCausalLM``; 50 for a config that only says ``model_type: llama``."""
    return score_architectures(config, ARCHITECTURES, MODEL_TYPES)


@hookimpl
def openinfer_claims() -> list[str]:
    return [*ARCHITECTURES, *MODEL_TYPES]


def load_rank_model(model_path: str, config: dict[str, Any], max_model_len: int | None, backend: Backend,
                    rank: RankContext) -> LlamaForCausalLM:
    """One rank's Llama (the whole model when there is one rank); picklable as a partial."""
    llama = LlamaConfig.from_dict(config, read_generation_config(model_path))
    return LlamaForCausalLM.load(model_path, llama, backend, max_model_len, rank)


@hookimpl
def openinfer_create_engine(model_path: str, config: dict[str, Any], options: EngineOptions) -> PagedEngine:
    model = create_parallel_model(partial(load_rank_model, model_path, config, options.max_model_len), options)
    return PagedEngine(model, options, model_path=model_path, plugin=PLUGIN_NAME)
