"""The pluggy hooks that make Qwen3.5 servable, and the engine glue.

A recurrent model cannot use the prefix cache (a cached KV block says nothing about the
GDN state at that point), and it can run at most one request per state slot, so the engine
is created with ``enable_prefix_cache=False`` and ``max_num_seqs`` capped by the slot pool.
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
    create_parallel_model,
    dense_model_memory,
    hookimpl,
    read_generation_config,
)
from openinfer_qwen35.config import ARCHITECTURES, MODEL_TYPES, Qwen35Config
from openinfer_qwen35.kernel_plan import plan_for
from openinfer_qwen35.model import Qwen35Model
from openinfer_qwen35.state import DeltaNetStateCache
from openinfer_qwen35.weights import load_weights, qwen35_tensor_shapes

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


def num_state_slots(config: Qwen35Config, options: EngineOptions, backend: Backend | None = None) -> int:
    """Slots for ``max_num_seqs`` requests (+ the null slot), within a state memory budget:
    ``cpu_kv_cache_gib`` on the CPU (the state gets a budget of its own), a quarter of the KV
    budget the backend reports on a GPU (the KV pool is sized after the state is allocated)."""
    budget_bytes = int(options.cpu_kv_cache_gib * 2**30)
    kv_budget = getattr(backend, "kv_memory_budget", None)
    if kv_budget is not None:
        budget_bytes = kv_budget(options) // 4
    budget = budget_bytes // max(1, DeltaNetStateCache.bytes_per_slot(config))
    return max(2, min(options.max_num_seqs, budget) + 1)


def build_model(model_path: str | Path, config: dict[str, Any], backend: Backend,
                options: EngineOptions, rank: RankContext | None = None) -> Qwen35Model:
    """One rank's Qwen3.5 (the whole model when there is one rank); picklable as a partial."""
    rank = rank or RankContext(load_format=options.load_format)
    qwen35 = Qwen35Config.from_dict(config, read_generation_config(model_path))
    local = qwen35.for_rank(rank.tensor)  # the rank's head counts; raises when heads do not split
    plan = plan_for(backend)
    source = (DummyCheckpoint(qwen35_tensor_shapes(qwen35)) if rank.load_format == "dummy"
              else Checkpoint(model_path))
    weights = load_weights(source, qwen35, backend, plan.fp32_vector, plan.norm_weight, rank.tensor)
    max_len = min(options.max_model_len or qwen35.max_position_embeddings, qwen35.max_position_embeddings)
    architectures = tuple(config.get("architectures") or ("Qwen3_5ForCausalLM",))
    return Qwen35Model(local, weights, backend, max_model_len=max_len,
                       num_state_slots=num_state_slots(local, options, backend), architectures=architectures,
                       model_type=str(config.get("model_type", "qwen3_5_text")), comm=rank.comm)


def engine_options(model: Qwen35Model, options: EngineOptions) -> EngineOptions:
    """What a recurrent model needs from the default engine: no prefix cache, one slot per
    running request, and (for now) eager decode steps — a captured CUDA graph would freeze the
    step's state-slot indices, which the model resolves from request ids on the host."""
    return options.with_(enable_prefix_cache=False, cuda_graph=False,
                         max_num_seqs=min(options.max_num_seqs, model.state.slots.num_usable_slots))


def _rank_model(model_path: str, config: dict[str, Any], options: EngineOptions, backend: Backend,
                rank: RankContext) -> Qwen35Model:
    return build_model(model_path, config, backend, options, rank)


@hookimpl
def openinfer_create_engine(model_path: str, config: dict[str, Any], options: EngineOptions) -> PagedEngine:
    model = create_parallel_model(partial(_rank_model, model_path, config, options), options,
                                  openinfer_model_memory(config), max_model_len=4096)
    rank0 = getattr(model, "local_model", model)  # a group: rank 0's own model holds the state slots
    return PagedEngine(model, engine_options(rank0, options), model_path=model_path, plugin=PLUGIN_NAME)


@hookimpl
def openinfer_model_memory(config: dict[str, Any]) -> ModelMemory:
    """bf16 weights; KV of the full-attention layers; the GDN state of ``max_num_seqs`` requests
    is sized by the engine at start (not in this plan)."""
    qwen35 = Qwen35Config.from_dict(config)
    kv_per_token = 2 * len(qwen35.full_layer_ids) * qwen35.num_key_value_heads * qwen35.head_dim * 2
    return dense_model_memory(qwen35_tensor_shapes(qwen35), num_kv_heads=qwen35.num_key_value_heads,
                              kv_bytes_per_token=kv_per_token,
                              description=f"qwen3.5 ({qwen35.num_hidden_layers} layers, hidden {qwen35.hidden_size})")
