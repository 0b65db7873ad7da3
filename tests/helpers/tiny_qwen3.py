"""Tiny random Qwen3 checkpoints written by tests (HF transformers is the reference, test-only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.helpers.hf_checkpoints import load_hf_float32, write_random_hf_checkpoint

TINY_QWEN3: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,  # heads * head_dim != hidden
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_tiny_qwen3(path: Path, seed: int = 0, dtype: str = "float32", **overrides: Any) -> Path:
    """config.json + model.safetensors of a tiny HF Qwen3 with every parameter randomized."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return write_random_hf_checkpoint(path, Qwen3Config, Qwen3ForCausalLM, {**TINY_QWEN3, **overrides}, seed, dtype)


load_hf = load_hf_float32
