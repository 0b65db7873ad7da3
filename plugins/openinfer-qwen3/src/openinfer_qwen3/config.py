"""Qwen3Config as found in config.json (transformers 4.x and 5.x spellings)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from openinfer import RopeParameters, WeightLoadError, eos_token_ids_from, rope_parameters_from_config

ARCHITECTURES = ("Qwen3ForCausalLM",)
MODEL_TYPES = ("qwen3",)


@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeParameters
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    architectures: tuple[str, ...]

    @classmethod
    def from_dict(cls, config: dict[str, Any], generation_config: dict[str, Any] | None = None) -> Qwen3Config:
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            return cls(
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_hidden_layers=int(config["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                max_position_embeddings=int(config.get("max_position_embeddings", 32768)),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope=rope_parameters_from_config(config, default_theta=1_000_000.0),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                attention_bias=bool(config.get("attention_bias", False)),
                eos_token_ids=eos_token_ids_from(config, generation_config),
                bos_token_id=config.get("bos_token_id"),
                architectures=tuple(config.get("architectures") or ARCHITECTURES),
            )
        except KeyError as exc:
            raise WeightLoadError(f"config.json lacks the Qwen3 field {exc.args[0]!r}") from exc
