"""Qwen3ForCausalLM on openinfer's backend ops: one definition for prefill, decode and mixed
steps, on NumPy and CUDA alike.

Per layer: RMSNorm → fused qkv → per-head q_norm/k_norm → NeoX RoPE → paged KV write → causal
GQA attention → o_proj → fused add+RMSNorm → SwiGLU MLP (fused gate_up). The math lives in
``openinfer.layers``; this class only binds Qwen3's layout to it.
"""

from __future__ import annotations

from pathlib import Path

from openinfer import Backend, DecoderConfig, DecoderOnlyLM, RankContext
from openinfer_qwen3.weights import QWEN3_LAYOUT


class Qwen3ForCausalLM(DecoderOnlyLM):
    @classmethod
    def load(cls, model_path: str | Path, config: DecoderConfig, backend: Backend,
             max_model_len: int | None = None, rank: RankContext | None = None) -> Qwen3ForCausalLM:
        return cls.from_pretrained(model_path, config, QWEN3_LAYOUT, backend, max_model_len, rank or RankContext())
