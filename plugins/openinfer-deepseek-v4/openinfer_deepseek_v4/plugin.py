"""The pluggy hooks that make DeepSeek-V4 servable, and the engine glue.

The model declares its caches as KV cache specs (``state.kv_cache_specs``), so the default
engine sizes, allocates and manages them: scheduling, chunked prefill, preemption and the
prefix cache (hits in whole compressed blocks, the compressors' open windows restored from
state snapshots) need nothing DeepSeek-specific here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from openinfer import (
    Backend,
    EngineOptions,
    PagedEngine,
    create_backend,
    hookimpl,
    read_generation_config,
    score_architectures,
)
from openinfer_deepseek_v4.chat import DeepseekV4ChatEncoder
from openinfer_deepseek_v4.checkpoint import DeepseekV4Checkpoint
from openinfer_deepseek_v4.config import ARCHITECTURES, MODEL_TYPES, DeepseekV4Config
from openinfer_deepseek_v4.model import DeepseekV4Model
from openinfer_deepseek_v4.weights import load_weights

PLUGIN_NAME = "openinfer-deepseek-v4"


@hookimpl
def openinfer_match(config: dict[str, Any]) -> int | None:
    return score_architectures(config, ARCHITECTURES, MODEL_TYPES)


@hookimpl
def openinfer_claims() -> list[str]:
    return [*ARCHITECTURES, *MODEL_TYPES]


def build_model(model_path: str | Path, config: dict[str, Any], backend: Backend,
                options: EngineOptions) -> DeepseekV4Model:
    dsv4 = DeepseekV4Config.from_dict(config, read_generation_config(model_path))
    weights = load_weights(DeepseekV4Checkpoint(model_path), dsv4, backend)
    max_len = min(options.max_model_len or dsv4.max_position_embeddings, dsv4.max_position_embeddings)
    architectures = tuple(config.get("architectures") or ARCHITECTURES)
    return DeepseekV4Model(dsv4, weights, backend, max_model_len=max_len, architectures=architectures,
                           model_type=str(config.get("model_type", "deepseek_v4")))


@hookimpl
def openinfer_chat_encoder(config: dict[str, Any]) -> DeepseekV4ChatEncoder | None:
    """DeepSeek-V4 checkpoints ship no Jinja chat template: the frontends use this encoder."""
    return DeepseekV4ChatEncoder() if openinfer_match(config) else None


def engine_options(options: EngineOptions) -> EngineOptions:
    """Eager decode steps for now (the NumPy backend has no graphs; CUDA kernels are not written)."""
    return options.with_(cuda_graph=False)


@hookimpl
def openinfer_create_engine(model_path: str, config: dict[str, Any], options: EngineOptions) -> PagedEngine:
    model = build_model(model_path, config, create_backend(options.device), options)
    return PagedEngine(model, engine_options(options), model_path=model_path, plugin=PLUGIN_NAME)
