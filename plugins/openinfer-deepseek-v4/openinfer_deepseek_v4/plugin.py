"""The pluggy hooks that make DeepSeek-V4 servable, and the engine glue.

The model declares its caches as KV cache specs (``state.kv_cache_specs``), so the default
engine sizes, allocates and manages them: scheduling, chunked prefill, preemption and the
prefix cache (hits in whole compressed blocks, the compressors' open windows restored from
state snapshots) need nothing DeepSeek-specific here.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Any

from openinfer import (
    Backend,
    EngineOptions,
    ModelMemory,
    PagedEngine,
    ParallelConfigError,
    RankContext,
    create_backend,
    create_paged_engine,
    hookimpl,
    name_hooks,
    read_generation_config,
)
from openinfer_deepseek_v4.chat import DeepseekV4ChatEncoder
from openinfer_deepseek_v4.checkpoint import DeepseekV4Checkpoint
from openinfer_deepseek_v4.config import ARCHITECTURES, MODEL_TYPES, DeepseekV4Config
from openinfer_deepseek_v4.dummy import DummyDeepseekV4Checkpoint
from openinfer_deepseek_v4.kernel_plan import fp8_linear_setting
from openinfer_deepseek_v4.memory import deepseek_v4_model_memory
from openinfer_deepseek_v4.model import DeepseekV4Model
from openinfer_deepseek_v4.weights import load_weights

PLUGIN_NAME = "openinfer-deepseek-v4"


openinfer_match, openinfer_claims = name_hooks(ARCHITECTURES, MODEL_TYPES)


def build_model(model_path: str | Path, config: dict[str, Any], backend: Backend,
                options: EngineOptions, rank: RankContext | None = None) -> DeepseekV4Model:
    """One rank's model (the whole model when there is one rank)."""
    dsv4 = DeepseekV4Config.from_dict(config, read_generation_config(model_path))
    rank = rank or RankContext()
    if rank.tensor.size > 1:
        raise ParallelConfigError("openinfer-deepseek-v4 splits the model by experts only: use "
                                  "--expert-parallel-size and leave --tensor-parallel-size at 1")
    held = rank.expert.experts(dsv4.n_routed_experts) if rank.expert.size > 1 else None
    stack_experts = dense_linear = None
    if backend.name == "cuda":  # routed experts stay in their stored format (FP4 / FP8), stacked per layer
        from openinfer_deepseek_v4 import cuda_ops
        from openinfer_deepseek_v4.cuda_experts import stack_experts

        cuda_ops.start_builds(dsv4.head_dim)  # NVRTC works in background threads while the weights load

        if fp8_linear_setting(os.environ) == "stream":  # FP8 dense linears too (opt-in)
            from openinfer_deepseek_v4.cuda_linears import stored_fp8_linear as dense_linear
    dummy = "dummy" in (options.load_format, rank.load_format)  # noise at the real shapes, no files
    checkpoint = DummyDeepseekV4Checkpoint(dsv4) if dummy else DeepseekV4Checkpoint(model_path)
    weights = load_weights(checkpoint, dsv4, backend, experts=held, stack_experts=stack_experts,
                           dense_linear=dense_linear)
    max_len = min(options.max_model_len or dsv4.max_position_embeddings, dsv4.max_position_embeddings)
    architectures = tuple(config.get("architectures") or ARCHITECTURES)
    return DeepseekV4Model(dsv4, weights, backend, max_model_len=max_len, architectures=architectures,
                           model_type=str(config.get("model_type", "deepseek_v4")), rank=rank)


def _rank_model(model_path: str, config: dict[str, Any], options: EngineOptions, backend: Backend,
                rank: RankContext) -> DeepseekV4Model:
    return build_model(model_path, config, backend, options, rank)


@hookimpl
def openinfer_chat_encoder(config: dict[str, Any]) -> DeepseekV4ChatEncoder | None:
    """DeepSeek-V4 checkpoints ship no Jinja chat template: the frontends use this encoder."""
    return DeepseekV4ChatEncoder() if openinfer_match(config) else None


def engine_options(options: EngineOptions) -> EngineOptions:
    """The options as given: on cuda, decode steps replay CUDA graphs unless ``cuda_graph`` is off
    (the forward reads its layout and the compressors' state slots from the static batch)."""
    return options


@hookimpl
def openinfer_create_engine(model_path: str, config: dict[str, Any], options: EngineOptions) -> PagedEngine:
    if options.expert_parallel_size == 1 and options.tensor_parallel_size == 1:
        model = build_model(model_path, config, create_backend(options.device), options)
        return PagedEngine(model, engine_options(options), model_path=model_path, plugin=PLUGIN_NAME)
    return create_paged_engine(PLUGIN_NAME, model_path, options, partial(_rank_model, model_path, config, options),
                               engine_options=engine_options(options))


@hookimpl
def openinfer_model_memory(config: dict[str, Any]) -> ModelMemory:
    return deepseek_v4_model_memory(DeepseekV4Config.from_dict(config))
