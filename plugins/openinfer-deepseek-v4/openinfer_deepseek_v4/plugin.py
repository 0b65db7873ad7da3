"""The pluggy hooks that make DeepSeek-V4 servable, and the engine glue.

The attention state lives in the model, per request (``state.RequestStates``), so the engine's
block pool holds no tensors for this model: it only meters tokens, which keeps the scheduler's
admission, chunked prefill and preemption (recompute from position 0) working. Its size comes
from the state's bytes per token (the compressed entries) after reserving every sequence's
sliding windows. The prefix cache stays off: a cached block would say nothing about the
compressors' open windows at that point.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from openinfer import Backend, EngineOptions, PagedEngine, create_backend, hookimpl, read_generation_config
from openinfer_deepseek_v4.chat import DeepseekV4ChatEncoder
from openinfer_deepseek_v4.checkpoint import DeepseekV4Checkpoint
from openinfer_deepseek_v4.config import ARCHITECTURES, CSA, MODEL_TYPES, DeepseekV4Config
from openinfer_deepseek_v4.model import DeepseekV4Model
from openinfer_deepseek_v4.weights import load_weights

PLUGIN_NAME = "openinfer-deepseek-v4"


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
                options: EngineOptions) -> DeepseekV4Model:
    dsv4 = DeepseekV4Config.from_dict(config, read_generation_config(model_path))
    weights = load_weights(DeepseekV4Checkpoint(model_path), dsv4, backend)
    max_len = min(options.max_model_len or dsv4.max_position_embeddings, dsv4.max_position_embeddings)
    architectures = tuple(config.get("architectures") or ARCHITECTURES)
    return DeepseekV4Model(dsv4, weights, backend, max_model_len=max_len, max_requests=options.max_num_seqs,
                           architectures=architectures, model_type=str(config.get("model_type", "deepseek_v4")))


@hookimpl
def openinfer_chat_encoder(config: dict[str, Any]) -> DeepseekV4ChatEncoder | None:
    """DeepSeek-V4 checkpoints ship no Jinja chat template: the frontends use this encoder."""
    return DeepseekV4ChatEncoder() if openinfer_match(config) else None


def state_bytes(config: DeepseekV4Config) -> tuple[int, int]:
    """(bytes per token of context, fixed bytes per sequence) of the fp32 attention state."""
    per_token = fixed = 0
    for layer in range(config.num_hidden_layers):
        fixed += 4 * config.sliding_window * config.head_dim
        rate = config.layer_compress_rate(layer)
        if rate:
            per_token += 4 * config.head_dim / rate
            fixed += 4 * 3 * rate * config.head_dim * 2  # open window + overlap, both projections
            if config.layer_types[layer] == CSA:
                per_token += 4 * config.index_head_dim / rate
                fixed += 4 * 3 * rate * config.index_head_dim * 2
    return max(1, int(per_token + 0.5)), fixed


def engine_options(model: DeepseekV4Model, options: EngineOptions) -> EngineOptions:
    if options.num_kv_blocks:
        blocks = options.num_kv_blocks
    else:
        per_token, fixed = state_bytes(model.config)
        budget = int(options.cpu_kv_cache_gib * 2**30) - fixed * options.max_num_seqs
        useful = options.max_num_seqs * -(-model.spec.max_model_len // options.block_size) + 1
        blocks = max(2, min(budget // (per_token * options.block_size), useful))
    return options.with_(enable_prefix_cache=False, cuda_graph=False, num_kv_blocks=blocks)


@hookimpl
def openinfer_create_engine(model_path: str, config: dict[str, Any], options: EngineOptions) -> PagedEngine:
    model = build_model(model_path, config, create_backend(options.device), options)
    return PagedEngine(model, engine_options(model, options), model_path=model_path, plugin=PLUGIN_NAME)
