"""The pluggy hooks that make Qwen3 servable: match a config.json, create the engine."""

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
from openinfer_qwen3.config import ARCHITECTURES, MODEL_TYPES, qwen3_config
from openinfer_qwen3.model import Qwen3ForCausalLM


@hookimpl
def openinfer_match(config: dict[str, Any]) -> int | None:
    return score_architectures(config, ARCHITECTURES, MODEL_TYPES)


@hookimpl
def openinfer_claims() -> list[str]:
    return [*ARCHITECTURES, *MODEL_TYPES]


@hookimpl
def openinfer_create_engine(model_path: str, config: dict[str, Any], options: EngineOptions) -> PagedEngine:
    model = Qwen3ForCausalLM.load(model_path, qwen3_config(config, read_generation_config(model_path)),
                                  create_backend(options.device), options.max_model_len)
    return PagedEngine(model, options, model_path=model_path, plugin="openinfer-qwen3")
