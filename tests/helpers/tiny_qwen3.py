"""Tiny random Qwen3 checkpoints written by tests (HF transformers is the reference, test-only)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
    """Write config.json + model.safetensors of a randomly initialised HF Qwen3, with every
    parameter randomized (norm weights too, which HF initialises to ones)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config_dict = {**TINY_QWEN3, **overrides}
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    hf_config = Qwen3Config(**{k: v for k, v in config_dict.items() if k not in ("architectures", "model_type")})
    model = Qwen3ForCausalLM(hf_config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            else:
                param.copy_(0.08 * torch.randn_like(param))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(path, safe_serialization=True)
    # keep the exact config dict we intend (legacy key names unless overridden)
    saved = json.loads((path / "config.json").read_text())
    saved.update(config_dict)
    (path / "config.json").write_text(json.dumps(saved, indent=2))
    return path


def load_hf(path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    model.eval()
    return model
