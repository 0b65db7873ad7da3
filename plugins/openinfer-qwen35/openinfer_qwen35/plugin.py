"""The pluggy hooks that make Qwen3.5 servable.

The model declares its GDN state as ``RecurrentStateSpec``s, so the default engine sizes the
state slots from memory (capping ``max_num_seqs`` by the live slots that fit), keeps the prefix
cache on (the state is snapshotted at block boundaries and restored on a hit) and captures
decode steps in CUDA graphs (slot ids are read from the batch's device arrays).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from openinfer import (
    Backend,
    Checkpoint,
    EngineOptions,
    PagedEngine,
    create_backend,
    hookimpl,
    read_generation_config,
)
from openinfer_qwen35.config import ARCHITECTURES, MODEL_TYPES, Qwen35Config
from openinfer_qwen35.kernel_plan import plan_for
from openinfer_qwen35.model import Qwen35Model
from openinfer_qwen35.weights import load_weights

PLUGIN_NAME = "openinfer-qwen35"


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


def build_model(model_path: str | Path, config: dict[str, Any], backend: Backend,
                options: EngineOptions) -> Qwen35Model:
    qwen35 = Qwen35Config.from_dict(config, read_generation_config(model_path))
    plan = plan_for(backend)
    weights = load_weights(Checkpoint(model_path), qwen35, backend, plan.fp32_vector, plan.norm_weight)
    max_len = min(options.max_model_len or qwen35.max_position_embeddings, qwen35.max_position_embeddings)
    architectures = tuple(config.get("architectures") or ("Qwen3_5ForCausalLM",))
    return Qwen35Model(qwen35, weights, backend, max_model_len=max_len, architectures=architectures,
                       model_type=str(config.get("model_type", "qwen3_5_text")))


@hookimpl
def openinfer_create_engine(model_path: str, config: dict[str, Any], options: EngineOptions) -> PagedEngine:
    model = build_model(model_path, config, create_backend(options.device), options)
    return PagedEngine(model, options, model_path=model_path, plugin=PLUGIN_NAME)
