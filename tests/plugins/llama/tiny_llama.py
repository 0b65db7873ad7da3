"""Tiny random Llama checkpoints written by tests (HF transformers is the reference, test-only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.helpers.hf_checkpoints import load_hf_float32, write_random_hf_checkpoint

TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 112,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# Llama 3.1's RoPE scaling, squeezed so that the tiny model's positions cross every band.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def write_tiny_llama(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """config.json + model.safetensors of a tiny HF Llama with every parameter randomized."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return write_random_hf_checkpoint(path, LlamaConfig, LlamaForCausalLM, {**TINY_LLAMA, **overrides}, seed)


load_hf = load_hf_float32
