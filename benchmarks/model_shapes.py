"""Model configs the benchmarks share (config.json contents; weights come from ``load_format="dummy"``
or from the benchmark that writes them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# a tiny Qwen3 for host-side benchmarks, where the model's forward is stubbed and weights do not matter
TINY_QWEN3: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 320, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 24, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}


def write_config_dir(path: Path, config: dict[str, Any], **overrides: Any) -> Path:
    """A model directory holding only ``config.json`` (serve it with ``load_format="dummy"``)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**config, **overrides}))
    return path
