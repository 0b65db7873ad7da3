"""The pluggy hooks that make Qwen3.5 servable.

The model declares its GDN state as ``RecurrentStateSpec``s, so the default engine sizes the
state slots from memory (capping ``max_num_seqs`` by the live slots that fit), keeps the prefix
cache on (the state is snapshotted at block boundaries and restored on a hit) and captures
decode steps in CUDA graphs (slot ids are read from the batch's device arrays).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from openinfer import (
    Backend,
    Checkpoint,
    DummyCheckpoint,
    EngineOptions,
    ModelMemory,
    PagedEngine,
    RankContext,
    create_paged_engine,
    dense_model_memory,
    hookimpl,
    name_hooks,
    read_generation_config,
)
from openinfer_qwen35.config import ARCHITECTURES, MODEL_TYPES, Qwen35Config
from openinfer_qwen35.kernel_plan import plan_for
from openinfer_qwen35.model import Qwen35Model
from openinfer_qwen35.weights import load_weights, qwen35_tensor_shapes

PLUGIN_NAME = "openinfer-qwen35"


openinfer_match, openinfer_claims = name_hooks(ARCHITECTURES, MODEL_TYPES)


def build_model(model_path: str | Path, config: dict[str, Any], backend: Backend,
                options: EngineOptions, rank: RankContext | None = None) -> Qwen35Model:
    """One rank's Qwen3.5 (the whole model when there is one rank); picklable as a partial."""
    rank = rank or RankContext(load_format=options.load_format)
    qwen35 = Qwen35Config.from_dict(config, read_generation_config(model_path))
    local = qwen35.for_rank(rank.tensor)  # the rank's head counts; raises when heads do not split
    plan = plan_for(backend)
    if plan.start_builds is not None:  # NVRTC works in background threads while the weights load
        plan.start_builds(local)
    source = (DummyCheckpoint(qwen35_tensor_shapes(qwen35)) if rank.load_format == "dummy"
              else Checkpoint(model_path))
    weights = load_weights(source, qwen35, backend, plan.fp32_vector, plan.norm_weight, rank.tensor)
    del source  # the checkpoint's memory maps
    max_len = min(options.max_model_len or qwen35.max_position_embeddings, qwen35.max_position_embeddings)
    architectures = tuple(config.get("architectures") or ("Qwen3_5ForCausalLM",))
    return Qwen35Model(local, weights, backend, max_model_len=max_len, architectures=architectures,
                       model_type=str(config.get("model_type", "qwen3_5_text")), comm=rank.comm)


def _rank_model(model_path: str, config: dict[str, Any], options: EngineOptions, backend: Backend,
                rank: RankContext) -> Qwen35Model:
    return build_model(model_path, config, backend, options, rank)


@hookimpl
def openinfer_create_engine(model_path: str, config: dict[str, Any], options: EngineOptions) -> PagedEngine:
    return create_paged_engine(PLUGIN_NAME, model_path, options, partial(_rank_model, model_path, config, options),
                               openinfer_model_memory(config), max_model_len=4096)


@hookimpl
def openinfer_model_memory(config: dict[str, Any]) -> ModelMemory:
    """bf16 weights; KV of the full-attention layers (the GDN state slots are sized by the
    engine at start from what is left, not in this plan)."""
    qwen35 = Qwen35Config.from_dict(config)
    kv_per_token = 2 * len(qwen35.full_layer_ids) * qwen35.num_key_value_heads * qwen35.head_dim * 2
    return dense_model_memory(qwen35_tensor_shapes(qwen35), num_kv_heads=qwen35.num_key_value_heads,
                              kv_bytes_per_token=kv_per_token,
                              description=f"qwen3.5 ({qwen35.num_hidden_layers} layers, hidden {qwen35.hidden_size})")
