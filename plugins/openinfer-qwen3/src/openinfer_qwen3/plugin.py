"""The pluggy hooks that make Qwen3 servable: match a config.json, create the engine."""

from __future__ import annotations

from typing import Any

from openinfer import EngineOptions, PagedEngine, create_backend, hookimpl, read_generation_config
from openinfer_qwen3.config import ARCHITECTURES, MODEL_TYPES, Qwen3Config
from openinfer_qwen3.model import Qwen3ForCausalLM


@hookimpl
def openinfer_match(config: dict[str, Any]) -> int | None:
    if any(a in ARCHITECTURES for a in config.get("architectures") or []):
        return 100
    if config.get("model_type") in MODEL_TYPES:
        return 50
    return None


@hookimpl
def openinfer_claims() -> list[str]:
    return [*ARCHITECTURES, *MODEL_TYPES]


@hookimpl
def openinfer_create_engine(model_path: str, config: dict[str, Any], options: EngineOptions) -> PagedEngine:
    qwen3 = Qwen3Config.from_dict(config, read_generation_config(model_path))
    backend = create_backend(options.device)
    model = Qwen3ForCausalLM.from_pretrained(model_path, qwen3, backend, options.max_model_len)
    return PagedEngine(model, options, model_path=model_path, plugin="openinfer-qwen3")
