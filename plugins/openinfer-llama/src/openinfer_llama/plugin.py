"""The pluggy hooks that make Llama checkpoints servable: match a config.json, create the engine."""

from __future__ import annotations

from openinfer import DecoderPlugin, name_hooks
from openinfer_llama.config import ARCHITECTURES, MODEL_TYPES, LlamaConfig
from openinfer_llama.model import LlamaForCausalLM
from openinfer_llama.weights import LLAMA_LAYOUT

PLUGIN_NAME = "openinfer-llama"
LLAMA = DecoderPlugin(PLUGIN_NAME, LlamaConfig.from_dict, LlamaForCausalLM.load, LLAMA_LAYOUT)

# 100 for ``LlamaForCausalLM``; 50 for a config that only says ``model_type: llama``.
openinfer_match, openinfer_claims = name_hooks(ARCHITECTURES, MODEL_TYPES)
openinfer_create_engine, openinfer_model_memory = LLAMA.hooks()
load_rank_model = LLAMA.load_rank_model
