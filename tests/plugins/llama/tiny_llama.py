"""Tiny random Llama checkpoints written by tests (HF transformers is the reference, test-only)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
    """Write config.json + model.safetensors of a randomly initialised HF Llama with every
    parameter randomized (norm weights and biases too, which HF initialises to ones / zeros)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config_dict = {**TINY_LLAMA, **overrides}
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    hf_config = LlamaConfig(**{k: v for k, v in config_dict.items() if k not in ("architectures", "model_type")})
    model = LlamaForCausalLM(hf_config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            else:
                param.copy_(0.08 * torch.randn_like(param))
    model.save_pretrained(path, safe_serialization=True)
    saved = json.loads((path / "config.json").read_text())
    saved.update(config_dict)  # keep the spelling under test (legacy rope_scaling vs rope_parameters)
    (path / "config.json").write_text(json.dumps(saved, indent=2))
    return path


def load_hf(path: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model
