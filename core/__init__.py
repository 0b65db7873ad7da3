"""openinfer: an LLM inference engine in Python (NumPy and CUDA backends, model plugins).

What this module exports is the public API that model plugins and applications build on;
``openinfer_llama`` (plugins/openinfer-llama) is written against nothing else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from openinfer.backend import AttentionSpec, Backend, KVLayer, create_backend, cuda_available
from openinfer.backend.base import ForwardBatch, StateLayer
from openinfer.decoder import (
    DecoderConfig,
    DecoderLayout,
    DecoderOnlyLM,
    decoder_model_memory,
    decoder_tensor_shapes,
    load_decoder_stack,
)
from openinfer.engine import EngineHandle, finish_reason_name
from openinfer.errors import (
    AmbiguousPluginError,
    ConfigNotFoundError,
    ConfigNotJSONError,
    InvalidRequestError,
    ModelPathNotFoundError,
    NoPluginError,
    OpenInferError,
    ParallelConfigError,
    PluginLoadError,
    QueueFullError,
    WeightLoadError,
)
from openinfer.hookspecs import hookimpl
from openinfer.kv.spec import (
    CompressedSpec,
    FullAttentionSpec,
    KVCacheGroups,
    KVCacheSpec,
    MLALatentSpec,
    RecurrentStateSpec,
    SlidingWindowSpec,
    StateTensor,
    group_specs,
)
from openinfer.layers import DecoderLayer, DecoderStack, eos_token_ids_from, fuse_rows
from openinfer.options import EngineOptions
from openinfer.parallel import (
    Communicator,
    DummyCheckpoint,
    ExpertShard,
    ParallelLayout,
    RankContext,
    TensorShard,
    VocabShard,
)
from openinfer.parallel.build import create_parallel_model
from openinfer.parallel.communicator import SingleRank
from openinfer.parallel.expert import expert_parallel_moe, expert_parallel_moe_sharded
from openinfer.parallel.memory_plan import ModelMemory, TensorPlacement, dense_model_memory
from openinfer.parallel.tensor import (
    column_rows,
    head_rows,
    row_columns,
    row_parallel_bias,
    vocab_parallel_embedding,
    vocab_parallel_logits,
    vocab_rows,
)
from openinfer.plugin_glue import create_paged_engine, name_hooks
from openinfer.plugins import discover_plugins, read_generation_config, read_model_config, score_architectures
from openinfer.rope import RopeParameters, RotaryEmbedding, rope_parameters_from_config
from openinfer.runtime import ModelSpec, PagedEngine, PagedModel
from openinfer.weights import Checkpoint, bf16_to_float32, float32_to_bf16

__version__ = "0.1.0"


def create_engine(model_path: str | Path, **options: Any) -> EngineHandle:
    """Build the engine for the model in ``model_path``, picking the best installed plugin.

    ``options`` are ``EngineOptions`` fields (device, max_model_len, num_kv_blocks, ...).
    """
    config = read_model_config(model_path)
    registry = discover_plugins()
    plugin_name = registry.select(config, str(Path(model_path) / "config.json"))
    return registry.create_engine(plugin_name, str(Path(model_path).resolve()), config,
                                  EngineOptions.from_kwargs(**options))


__all__ = [
    "AmbiguousPluginError", "AttentionSpec", "Backend", "Checkpoint", "ConfigNotFoundError",
    "ConfigNotJSONError", "EngineHandle", "EngineOptions", "ForwardBatch", "InvalidRequestError",
    "KVLayer", "ModelPathNotFoundError", "ModelSpec", "NoPluginError", "OpenInferError", "PagedEngine",
    "PagedModel", "PluginLoadError", "QueueFullError", "RopeParameters", "RotaryEmbedding",
    "WeightLoadError", "bf16_to_float32", "create_backend", "create_engine", "cuda_available",
    "discover_plugins", "finish_reason_name", "float32_to_bf16", "hookimpl", "read_model_config",
    "rope_parameters_from_config", "DecoderLayer", "DecoderStack", "eos_token_ids_from", "fuse_rows",
    "read_generation_config", "DecoderConfig", "DecoderLayout", "DecoderOnlyLM", "load_decoder_stack",
    "score_architectures", "CompressedSpec", "FullAttentionSpec", "KVCacheGroups", "KVCacheSpec",
    "MLALatentSpec", "RecurrentStateSpec", "SlidingWindowSpec", "StateLayer", "StateTensor", "group_specs",
    "Communicator", "DummyCheckpoint", "ExpertShard", "ParallelLayout", "RankContext",
    "TensorShard", "VocabShard", "create_parallel_model", "SingleRank", "column_rows", "head_rows", "row_columns",
    "row_parallel_bias", "vocab_parallel_embedding", "vocab_parallel_logits", "vocab_rows", "ModelMemory",
    "TensorPlacement", "dense_model_memory", "decoder_model_memory", "decoder_tensor_shapes",
    "expert_parallel_moe", "expert_parallel_moe_sharded", "ParallelConfigError", "create_paged_engine", "name_hooks",
]
