"""The pluggy hooks that make Llama checkpoints servable: match a config.json, create the engine."""

from __future__ import annotations

from typing import Any

from openinfer import (
    EngineOptions,
    PagedEngine,
    create_backend,
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


@hookimpl
def openinfer_create_engine(model_path: str, config: dict[str, Any], options: EngineOptions) -> PagedEngine:
    llama = LlamaConfig.from_dict(config, read_generation_config(model_path))
    model = LlamaForCausalLM.load(model_path, llama, create_backend(options.device), options.max_model_len)
    return PagedEngine(model, options, model_path=model_path, plugin=PLUGIN_NAME)
