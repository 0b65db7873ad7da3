"""The pluggy hooks that make Kimi-K2 / DeepSeek-V3 checkpoints servable, and the engine glue."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from openinfer import (
    Backend,
    Checkpoint,
    EngineOptions,
    ModelMemory,
    PagedEngine,
    ParallelConfigError,
    RankContext,
    create_backend,
    create_paged_engine,
    hookimpl,
    read_generation_config,
)
from openinfer_kimi_k2.config import (
    ARCHITECTURES,
    MODEL_TYPES,
    KimiK2Config,
    text_config_of,
    with_message_end_stop,
)
from openinfer_kimi_k2.kernel_plan import plan_for
from openinfer_kimi_k2.memory import kimi_model_memory
from openinfer_kimi_k2.model import KimiK2Model
from openinfer_kimi_k2.weights import DummyKimiCheckpoint, load_weights, plan_checkpoint

PLUGIN_NAME = "openinfer-kimi-k2"


@hookimpl
def openinfer_match(config: dict[str, Any]) -> int | None:
    text = text_config_of(config)
    model_types = {config.get("model_type"), text.get("model_type")}
    if model_types & {"kimi_k2", "kimi_k25"}:
        return 100
    architectures = set(config.get("architectures") or []) | set(text.get("architectures") or [])
    if architectures & set(ARCHITECTURES):
        return 100
    if model_types & set(MODEL_TYPES):
        return 50
    return None


@hookimpl
def openinfer_claims() -> list[str]:
    return [*ARCHITECTURES, *MODEL_TYPES]


def build_model(model_path: str | Path, config: dict[str, Any], options: EngineOptions,
                backend: Backend | None = None, rank: RankContext | None = None) -> KimiK2Model:
    """Parse the config and check every tensor from the safetensors headers first, so a bad
    checkpoint fails with the tensor's name before the backend (and any device memory) exists."""
    kimi = with_message_end_stop(KimiK2Config.from_dict(config, read_generation_config(model_path)), model_path)
    rank = rank or RankContext()
    if rank.tensor.size > 1:
        raise ParallelConfigError("openinfer-kimi-k2 splits the model by experts only: use --expert-parallel-size "
                                  "and leave --tensor-parallel-size at 1")
    held = rank.expert.experts(kimi.n_routed_experts) if kimi.n_routed_experts else None
    dummy = "dummy" in (options.load_format, rank.load_format)
    checkpoint = DummyKimiCheckpoint(kimi) if dummy else Checkpoint(model_path)
    linears = plan_checkpoint(checkpoint, kimi)
    backend = backend or create_backend(options.device)
    plan = plan_for(backend)
    if rank.layout.attention_data_parallel and backend.name != "numpy":
        raise ParallelConfigError("openinfer-kimi-k2 runs data-parallel attention on the numpy backend only so far; "
                                  "leave it off on cuda (expert parallel alone runs there)")
    weights = load_weights(checkpoint, kimi, backend, linears=linears, builder=plan.builder, experts=held)
    plan.prepare(weights, backend)
    max_len = min(options.max_model_len or kimi.max_position_embeddings, kimi.max_position_embeddings)
    architectures = tuple(config.get("architectures") or ("DeepseekV3ForCausalLM",))
    return KimiK2Model(kimi, weights, backend, max_model_len=max_len, architectures=architectures, rank=rank)


def _rank_model(model_path: str, config: dict[str, Any], options: EngineOptions, backend: Backend,
                rank: RankContext) -> KimiK2Model:
    return build_model(model_path, config, options, backend, rank)


@hookimpl
def openinfer_create_engine(model_path: str, config: dict[str, Any], options: EngineOptions) -> PagedEngine:
    if options.expert_parallel_size == 1 and options.tensor_parallel_size == 1:
        return PagedEngine(build_model(model_path, config, options), options, model_path=model_path,
                           plugin=PLUGIN_NAME)
    return create_paged_engine(PLUGIN_NAME, model_path, options, partial(_rank_model, model_path, config, options))


@hookimpl
def openinfer_model_memory(config: dict[str, Any]) -> ModelMemory:
    return kimi_model_memory(KimiK2Config.from_dict(config))
