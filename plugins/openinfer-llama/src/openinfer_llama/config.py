"""``LlamaConfig``: the fields of a Llama config.json this plugin reads, checked once.

Both transformers spellings are accepted: 4.x (``rope_theta`` + ``rope_scaling``) and 5.x
(``rope_parameters``). RoPE types served: ``default`` and ``llama3`` (Llama 3.1+), plus
``linear`` and ``yarn``, which openinfer's RoPE tables also implement. ``pretraining_tp`` is
ignored: it only changes how transformers slices its matmuls, not the math.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from openinfer import RopeParameters, WeightLoadError, eos_token_ids_from, rope_parameters_from_config

ARCHITECTURES = ("LlamaForCausalLM",)
MODEL_TYPES = ("llama",)
SUPPORTED_ACTIVATIONS = ("silu",)


@dataclass(frozen=True)
class LlamaConfig:
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
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    architectures: tuple[str, ...]

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, config: dict[str, Any], generation_config: dict[str, Any] | None = None) -> LlamaConfig:
        """Read ``config.json`` (and ``generation_config.json`` for extra eos ids)."""
        activation = config.get("hidden_act", "silu")
        if activation not in SUPPORTED_ACTIVATIONS:
            raise WeightLoadError(
                f"config.json has hidden_act={activation!r}; openinfer-llama serves {SUPPORTED_ACTIVATIONS} only")
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            kv_heads = int(config.get("num_key_value_heads") or heads)
            parsed = cls(
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_hidden_layers=int(config["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                head_dim=int(config.get("head_dim") or hidden // heads),
                max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope=rope_parameters_from_config(config, default_theta=10000.0),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                attention_bias=bool(config.get("attention_bias", False)),
                mlp_bias=bool(config.get("mlp_bias", False)),
                eos_token_ids=eos_token_ids_from(config, generation_config),
                bos_token_id=config.get("bos_token_id"),
                architectures=tuple(config.get("architectures") or ARCHITECTURES),
            )
        except KeyError as exc:
            raise WeightLoadError(f"config.json lacks the Llama field {exc.args[0]!r}") from exc
        if heads % kv_heads:
            raise WeightLoadError(
                f"config.json has num_attention_heads={heads}, not a multiple of num_key_value_heads={kv_heads}")
        return parsed
