"""Qwen3.5 configuration: reading ``config.json`` (text-only or multimodal) into one dataclass.

Two spellings reach us:

- text checkpoints (``Qwen3_5ForCausalLM``, model_type ``qwen3_5_text``): fields at the top;
- multimodal checkpoints (``Qwen3_5ForConditionalGeneration``, model_type ``qwen3_5``): the
  language model's fields under ``text_config``; ``vision_config`` is ignored (text only).

Layer kinds come from ``layer_types`` ("linear_attention" | "full_attention") or, in older
configs, from ``full_attention_interval`` (every n-th layer is full attention). RoPE is read by
core's ``rope_parameters_from_config``; Qwen3.5 defaults ``partial_rotary_factor`` to 0.25, and
``mrope_section`` reduces to plain 1-D RoPE for text (all three position rows are equal).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from openinfer import (
    RopeParameters,
    TensorShard,
    WeightLoadError,
    eos_token_ids_from,
    rope_parameters_from_config,
)

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25


@dataclass(frozen=True)
class Qwen35Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    # full (gated) attention layers
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    # Gated DeltaNet (linear attention) layers
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    rope: RopeParameters
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    is_multimodal: bool

    # --- derived sizes ----------------------------------------------------------------------------

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise conv: ``[q | k | v]`` of one token."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def linear_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == LINEAR_ATTENTION)

    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == FULL_ATTENTION)

    # --- reading config.json ----------------------------------------------------------------------

    @classmethod
    def from_dict(cls, config: dict[str, Any], generation_config: dict[str, Any] | None = None) -> Qwen35Config:
        text = text_config_of(config)
        num_layers = int(text["num_hidden_layers"])
        layer_types = _layer_types(text, num_layers)
        act = text.get("hidden_act", "silu")
        if act != "silu":
            raise WeightLoadError(f"Qwen3.5 config has hidden_act={act!r}; only 'silu' is supported")
        if text.get("num_experts"):
            raise WeightLoadError("this is a Qwen3.5 MoE config (num_experts is set); openinfer-qwen35 "
                                  "serves the dense Qwen3.5 models only")
        if text.get("attn_output_gate", True) is False:
            raise WeightLoadError("Qwen3.5 config has attn_output_gate=false; openinfer-qwen35 expects "
                                  "gated full attention (q_proj yielding [query | gate] per head)")
        rope_source = dict(text)
        params = dict(text.get("rope_parameters") or {})
        if "partial_rotary_factor" not in params and "partial_rotary_factor" not in text:
            params["partial_rotary_factor"] = DEFAULT_PARTIAL_ROTARY_FACTOR
        # mrope keys describe the multimodal (t, h, w) split; for text the rows are equal → 1-D.
        params.pop("mrope_section", None)
        params.pop("mrope_interleaved", None)
        rope_source["rope_parameters"] = params
        hidden = int(text["hidden_size"])
        num_heads = int(text["num_attention_heads"])
        tie = text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
        return cls(
            vocab_size=int(text["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(text["intermediate_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=int(text.get("num_key_value_heads", num_heads)),
            head_dim=int(text.get("head_dim") or hidden // num_heads),
            attention_bias=bool(text.get("attention_bias", False)),
            linear_num_key_heads=int(text["linear_num_key_heads"]),
            linear_num_value_heads=int(text["linear_num_value_heads"]),
            linear_key_head_dim=int(text["linear_key_head_dim"]),
            linear_value_head_dim=int(text["linear_value_head_dim"]),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            layer_types=layer_types,
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope=rope_parameters_from_config(rope_source),
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(tie),
            eos_token_ids=eos_token_ids_from({"eos_token_id": text.get("eos_token_id", config.get("eos_token_id"))},
                                             generation_config),
            is_multimodal="text_config" in config,
        ).validated()

    def for_rank(self, shard: TensorShard) -> Qwen35Config:
        """The sizes one tensor-parallel rank computes with: its attention heads and KV heads,
        its GDN value heads and key heads (key heads, like KV heads, are replicated when the
        group is larger than their number). Raises ``ParallelConfigError`` when they do not split."""
        if shard.size == 1:
            return self
        heads = shard.split(self.num_attention_heads, "num_attention_heads")
        kv_heads = shard.kv_heads(self.num_key_value_heads)
        value_heads = shard.split(self.linear_num_value_heads, "linear_num_value_heads")
        key_heads = shard.kv_heads(self.linear_num_key_heads)
        return replace(self, num_attention_heads=heads.stop - heads.start,
                       num_key_value_heads=kv_heads.stop - kv_heads.start,
                       linear_num_value_heads=value_heads.stop - value_heads.start,
                       linear_num_key_heads=key_heads.stop - key_heads.start).validated()

    def validated(self) -> Qwen35Config:
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise WeightLoadError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise WeightLoadError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        return self


def text_config_of(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's fields: ``text_config`` of a multimodal config, else the config."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _layer_types(text: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    kinds = text.get("layer_types")
    if kinds is None:
        interval = int(text.get("full_attention_interval", 4))
        kinds = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)]
    kinds = tuple(kinds)[:num_layers]
    unknown = sorted(set(kinds) - {LINEAR_ATTENTION, FULL_ATTENTION})
    if unknown or len(kinds) != num_layers:
        raise WeightLoadError(
            f"Qwen3.5 layer_types must list {num_layers} entries of {LINEAR_ATTENTION!r} / "
            f"{FULL_ATTENTION!r}; got {len(kinds)} with unknown kinds {unknown}")
    return kinds
