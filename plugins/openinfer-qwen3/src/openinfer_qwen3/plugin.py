"""The pluggy hooks that make Qwen3 servable: match a config.json, create the engine."""

from __future__ import annotations

from openinfer import DecoderPlugin, name_hooks
from openinfer_qwen3.config import ARCHITECTURES, MODEL_TYPES, qwen3_config
from openinfer_qwen3.model import Qwen3ForCausalLM
from openinfer_qwen3.weights import QWEN3_LAYOUT

QWEN3 = DecoderPlugin("openinfer-qwen3", qwen3_config, Qwen3ForCausalLM.load, QWEN3_LAYOUT)

openinfer_match, openinfer_claims = name_hooks(ARCHITECTURES, MODEL_TYPES)
openinfer_create_engine, openinfer_model_memory = QWEN3.hooks()
load_rank_model = QWEN3.load_rank_model
