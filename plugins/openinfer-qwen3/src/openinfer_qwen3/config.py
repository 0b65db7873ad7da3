"""Qwen3Config: the dense decoder fields plus Qwen3's defaults (rope_theta 1e6, 32k context)."""

from __future__ import annotations

from typing import Any

from openinfer import DecoderConfig

ARCHITECTURES = ("Qwen3ForCausalLM",)
MODEL_TYPES = ("qwen3",)


def qwen3_config(config: dict[str, Any], generation_config: dict[str, Any] | None = None) -> DecoderConfig:
    """Read a Qwen3 config.json (legacy ``rope_theta``/``rope_scaling`` or 5.x ``rope_parameters``)."""
    return DecoderConfig.from_dict(config, generation_config, model_type="qwen3", architectures=ARCHITECTURES,
                                   default_rope_theta=1_000_000.0, default_max_position_embeddings=32768)
