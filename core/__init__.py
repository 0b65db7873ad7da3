"""openinfer: an LLM inference engine in Python (NumPy and CUDA backends, model plugins).

What this module exports is the public API that model plugins and applications build on;
``openinfer_llama`` (plugins/openinfer-llama) is written against nothing else.

Importing ``openinfer`` is cheap: every exported name is imported on first use (PEP 562), so a
process that needs only the engine client or the CLI's argument parser does not pay for NumPy,
the runtime and every backend at start-up (it sits on the cold-start critical path).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same names, eagerly, for type checkers and IDEs
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
    from openinfer.plugin_glue import DecoderPlugin, create_paged_engine, name_hooks
    from openinfer.plugins import (
        discover_plugins,
        read_generation_config,
        read_model_config,
        score_architectures,
    )
    from openinfer.rope import RopeParameters, RotaryEmbedding, rope_parameters_from_config
    from openinfer.runtime import ModelSpec, PagedEngine, PagedModel
    from openinfer.weights import Checkpoint, bf16_to_float32, float32_to_bf16

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "AttentionSpec": "openinfer.backend",
    "Backend": "openinfer.backend",
    "KVLayer": "openinfer.backend",
    "create_backend": "openinfer.backend",
    "cuda_available": "openinfer.backend",
    "ForwardBatch": "openinfer.backend.base",
    "StateLayer": "openinfer.backend.base",
    "DecoderConfig": "openinfer.decoder",
    "DecoderLayout": "openinfer.decoder",
    "DecoderOnlyLM": "openinfer.decoder",
    "decoder_model_memory": "openinfer.decoder",
    "decoder_tensor_shapes": "openinfer.decoder",
    "load_decoder_stack": "openinfer.decoder",
    "EngineHandle": "openinfer.engine",
    "finish_reason_name": "openinfer.engine",
    "AmbiguousPluginError": "openinfer.errors",
    "ConfigNotFoundError": "openinfer.errors",
    "ConfigNotJSONError": "openinfer.errors",
    "InvalidRequestError": "openinfer.errors",
    "ModelPathNotFoundError": "openinfer.errors",
    "NoPluginError": "openinfer.errors",
    "OpenInferError": "openinfer.errors",
    "ParallelConfigError": "openinfer.errors",
    "PluginLoadError": "openinfer.errors",
    "QueueFullError": "openinfer.errors",
    "WeightLoadError": "openinfer.errors",
    "hookimpl": "openinfer.hookspecs",
    "CompressedSpec": "openinfer.kv.spec",
    "FullAttentionSpec": "openinfer.kv.spec",
    "KVCacheGroups": "openinfer.kv.spec",
    "KVCacheSpec": "openinfer.kv.spec",
    "MLALatentSpec": "openinfer.kv.spec",
    "RecurrentStateSpec": "openinfer.kv.spec",
    "SlidingWindowSpec": "openinfer.kv.spec",
    "StateTensor": "openinfer.kv.spec",
    "group_specs": "openinfer.kv.spec",
    "DecoderLayer": "openinfer.layers",
    "DecoderStack": "openinfer.layers",
    "eos_token_ids_from": "openinfer.layers",
    "fuse_rows": "openinfer.layers",
    "EngineOptions": "openinfer.options",
    "Communicator": "openinfer.parallel",
    "DummyCheckpoint": "openinfer.parallel",
    "ExpertShard": "openinfer.parallel",
    "ParallelLayout": "openinfer.parallel",
    "RankContext": "openinfer.parallel",
    "TensorShard": "openinfer.parallel",
    "VocabShard": "openinfer.parallel",
    "create_parallel_model": "openinfer.parallel.build",
    "SingleRank": "openinfer.parallel.communicator",
    "expert_parallel_moe": "openinfer.parallel.expert",
    "expert_parallel_moe_sharded": "openinfer.parallel.expert",
    "ModelMemory": "openinfer.parallel.memory_plan",
    "TensorPlacement": "openinfer.parallel.memory_plan",
    "dense_model_memory": "openinfer.parallel.memory_plan",
    "column_rows": "openinfer.parallel.tensor",
    "head_rows": "openinfer.parallel.tensor",
    "row_columns": "openinfer.parallel.tensor",
    "row_parallel_bias": "openinfer.parallel.tensor",
    "vocab_parallel_embedding": "openinfer.parallel.tensor",
    "vocab_parallel_logits": "openinfer.parallel.tensor",
    "vocab_rows": "openinfer.parallel.tensor",
    "create_paged_engine": "openinfer.plugin_glue",
    "DecoderPlugin": "openinfer.plugin_glue",
    "name_hooks": "openinfer.plugin_glue",
    "discover_plugins": "openinfer.plugins",
    "read_generation_config": "openinfer.plugins",
    "read_model_config": "openinfer.plugins",
    "score_architectures": "openinfer.plugins",
    "RopeParameters": "openinfer.rope",
    "RotaryEmbedding": "openinfer.rope",
    "rope_parameters_from_config": "openinfer.rope",
    "ModelSpec": "openinfer.runtime",
    "PagedEngine": "openinfer.runtime",
    "PagedModel": "openinfer.runtime",
    "Checkpoint": "openinfer.weights",
    "bf16_to_float32": "openinfer.weights",
    "float32_to_bf16": "openinfer.weights",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        try:  # a submodule reached as an attribute (``openinfer.weights``)
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


def create_engine(model_path: str | Path, **options: Any) -> EngineHandle:
    """Build the engine for the model in ``model_path``, picking the best installed plugin.

    ``options`` are ``EngineOptions`` fields (device, max_model_len, num_kv_blocks, ...).
    """
    from openinfer.engine_core.startup import note_event
    from openinfer.options import EngineOptions
    from openinfer.plugins import discover_plugins, read_model_config

    config = read_model_config(model_path)
    registry = discover_plugins()
    plugin_name = registry.select(config, str(Path(model_path) / "config.json"))
    note_event("plugin_selected")  # a start-up event: plugins discovered (their entry points imported)
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
    "expert_parallel_moe", "expert_parallel_moe_sharded", "ParallelConfigError", "create_paged_engine", "DecoderPlugin", "name_hooks",
]
