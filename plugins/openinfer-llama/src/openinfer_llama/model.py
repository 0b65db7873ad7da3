"""``LlamaForCausalLM`` on openinfer's backend ops: one definition for prefill, decode and mixed
steps, on NumPy and CUDA alike.

Per layer (``openinfer.DecoderLayer``): RMSNorm → fused qkv → RoPE (default or llama3 scaled) →
paged KV write → causal GQA attention → o_proj → fused add + RMSNorm → SwiGLU MLP (fused
gate_up) → down. Logits are computed only for the rows the engine samples.
"""

from __future__ import annotations

from pathlib import Path

from openinfer import Backend, DecoderOnlyLM, RankContext
from openinfer_llama.config import LlamaConfig
from openinfer_llama.weights import LLAMA_LAYOUT


class LlamaForCausalLM(DecoderOnlyLM):
    """An ``openinfer.PagedModel``: ``spec``, ``backend`` and ``forward(batch, kv_cache)``."""

    @classmethod
    def load(cls, model_path: str | Path, config: LlamaConfig, backend: Backend,
             max_model_len: int | None = None, rank: RankContext | None = None) -> LlamaForCausalLM:
        return cls.from_pretrained(model_path, config, LLAMA_LAYOUT, backend, max_model_len, rank or RankContext())
