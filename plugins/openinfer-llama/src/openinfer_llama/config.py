"""``LlamaConfig``: the dense-decoder fields of a Llama config.json, read once and checked.

Both transformers spellings are accepted: 4.x (``rope_theta`` + ``rope_scaling``) and 5.x
(``rope_parameters``). RoPE types served: ``default`` and ``llama3`` (Llama 3.1+), plus
``linear`` and ``yarn``, which openinfer's RoPE tables also implement. ``pretraining_tp`` is
ignored: it only changes how transformers slices its matmuls, not the math.
"""

from __future__ import annotations

from typing import Any

from openinfer import DecoderConfig

ARCHITECTURES = ("LlamaForCausalLM",)
MODEL_TYPES = ("llama",)


class LlamaConfig(DecoderConfig):
    """``openinfer.DecoderConfig`` with Llama's defaults (rope_theta 10000, 2048 positions)."""

    @classmethod
    def from_dict(cls, config: dict[str, Any], generation_config: dict[str, Any] | None = None,
                  **_: Any) -> LlamaConfig:
        """Read ``config.json`` (and ``generation_config.json`` for extra eos ids)."""
        return super().from_dict(config, generation_config, model_type="llama", architectures=ARCHITECTURES,
                                 default_rope_theta=10000.0, default_max_position_embeddings=2048)
