"""Kimi-K2 / DeepSeek-V3 configuration: ``config.json`` (top level or under ``text_config``) → one dataclass.

Both key spellings reach us: real checkpoints use ``rope_theta`` + ``rope_scaling``; HF 5.x
``save_pretrained`` writes ``rope_parameters``. YaRN's ``mscale_all_dim`` scales the softmax
(``qk_head_dim^-0.5 · mscale²``, ``mscale = 0.1·ln(factor)·mscale_all_dim + 1``); the cos/sin
tables carry YaRN's attention factor (1.0 when ``mscale == mscale_all_dim``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from openinfer import RopeParameters, WeightLoadError, eos_token_ids_from, rope_parameters_from_config
from openinfer.moe import RouterSpec
from openinfer.quant import QuantConfig, quant_config_from

ARCHITECTURES = ("DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration")
MODEL_TYPES = ("kimi_k2", "kimi_k25", "deepseek_v3")
TOPK_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")


def text_config_of(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's fields: ``text_config`` for multimodal wrappers (Kimi-K2.5), else the top level."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


@dataclass(frozen=True)
class KimiK2Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense (first_k_dense_replace) layers
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    router: RouterSpec | None
    rms_norm_eps: float
    rope: RopeParameters
    rope_interleave: bool
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    quant: QuantConfig
    model_type: str

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return (self.router is not None and layer >= self.first_k_dense_replace
                and layer % self.moe_layer_freq == 0)

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim^-0.5``, times ``mscale²`` for YaRN with ``mscale_all_dim`` (as HF and the
        official DeepSeek code do)."""
        scale = self.qk_head_dim ** -0.5
        mscale_all_dim = self.rope.get("mscale_all_dim")
        factor = self.rope.get("factor")
        if self.rope.rope_type != "default" and mscale_all_dim and factor and float(factor) > 1:
            mscale = 0.1 * float(mscale_all_dim) * math.log(float(factor)) + 1.0
            scale *= mscale * mscale
        return scale

    @classmethod
    def from_dict(cls, config: dict[str, Any], generation_config: dict[str, Any] | None = None) -> KimiK2Config:
        text = text_config_of(config)

        def need(key: str) -> Any:
            if key not in text:
                raise WeightLoadError(f"config.json lacks {key!r}, which a DeepSeek-V3/Kimi-K2 model needs")
            return text[key]

        num_heads = int(need("num_attention_heads"))
        n_routed = int(text.get("n_routed_experts") or 0)
        router = None
        if n_routed:
            topk_method = text.get("topk_method", "noaux_tc")
            if topk_method not in TOPK_METHODS:
                raise WeightLoadError(f"config.json topk_method={topk_method!r} is not supported "
                                      f"(supported: {', '.join(TOPK_METHODS)})")
            scoring = text.get("scoring_func", "sigmoid")
            router = RouterSpec(
                num_experts=n_routed, top_k=int(need("num_experts_per_tok")), scoring=scoring,
                num_groups=int(text.get("n_group") or 1), topk_groups=int(text.get("topk_group") or 1),
                group_score="max" if topk_method == "group_limited_greedy" else "top2_sum",
                norm_topk_prob=bool(text.get("norm_topk_prob", True)),
                routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0)))
        q_lora = text.get("q_lora_rank")
        bos = text.get("bos_token_id", config.get("bos_token_id"))
        freq = int(text.get("moe_layer_freq", 1) or 1)
        return cls(
            vocab_size=int(need("vocab_size")), hidden_size=int(need("hidden_size")),
            intermediate_size=int(need("intermediate_size")),
            moe_intermediate_size=int(text.get("moe_intermediate_size") or 0),
            num_hidden_layers=int(need("num_hidden_layers")), num_attention_heads=num_heads,
            q_lora_rank=int(q_lora) if q_lora else None, kv_lora_rank=int(need("kv_lora_rank")),
            qk_nope_head_dim=int(need("qk_nope_head_dim")), qk_rope_head_dim=int(need("qk_rope_head_dim")),
            v_head_dim=int(need("v_head_dim")), n_routed_experts=n_routed,
            n_shared_experts=int(text.get("n_shared_experts") or 0),
            first_k_dense_replace=int(text.get("first_k_dense_replace", 0) or 0), moe_layer_freq=freq,
            router=router, rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope=rope_parameters_from_config(text),
            rope_interleave=bool(text.get("rope_interleave", True)),
            max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
            eos_token_ids=eos_token_ids_from(text, generation_config) or eos_token_ids_from(config),
            bos_token_id=bos if isinstance(bos, int) else None,
            quant=quant_config_from(text if "quantization_config" in text else config),
            model_type=str(config.get("model_type", "deepseek_v3")))


MESSAGE_END_TOKEN = "<|im_end|>"


def with_message_end_stop(config: KimiK2Config, model_path: str | Path) -> KimiK2Config:
    """Kimi chat ends a reply with ``<|im_end|>``, which config.json's ``eos_token_id`` ([EOS])
    does not name: add its id (from tokenizer_config.json's ``added_tokens_decoder``) to the stops."""
    path = Path(model_path) / "tokenizer_config.json"
    try:
        decoder = json.loads(path.read_text(encoding="utf-8")).get("added_tokens_decoder") or {}
    except (OSError, ValueError):
        return config
    for key, entry in decoder.items():
        content = entry.get("content") if isinstance(entry, dict) else entry
        if content == MESSAGE_END_TOKEN and str(key).isdigit() and int(key) not in config.eos_token_ids:
            return replace(config, eos_token_ids=(*config.eos_token_ids, int(key)))
    return config
