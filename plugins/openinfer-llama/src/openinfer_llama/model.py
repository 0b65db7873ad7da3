"""``LlamaForCausalLM`` on openinfer's backend ops: one definition for prefill, decode and mixed
steps, on NumPy and CUDA alike.

Per layer (openinfer.DecoderLayer): RMSNorm → fused qkv → RoPE (default or llama3 scaled) →
paged KV write → causal GQA attention → o_proj → fused add + RMSNorm → SwiGLU MLP (fused
gate_up) → down. Logits are computed only for the rows the engine samples.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tqdm import tqdm

from openinfer import Backend, Checkpoint, KVLayer, ModelSpec, RotaryEmbedding
from openinfer_llama.config import LlamaConfig
from openinfer_llama.weights import load_llama


class LlamaForCausalLM:
    """An ``openinfer.PagedModel``: ``spec``, ``backend`` and ``forward(batch, kv_cache)``."""

    def __init__(self, config: LlamaConfig, backend: Backend, checkpoint: Checkpoint,
                 max_model_len: int | None = None):
        self.config = config
        self.backend = backend
        max_len = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        rope = RotaryEmbedding.create(config.head_dim, config.rope, max_len, config.max_position_embeddings)
        with tqdm(total=config.num_hidden_layers, desc="loading Llama layers", unit="layer",
                  disable=None, leave=False) as progress:
            self.stack = load_llama(checkpoint, config, backend, rope, progress)
        self.spec = ModelSpec(
            architectures=config.architectures, model_type="llama", vocab_size=config.vocab_size,
            max_model_len=max_len, num_layers=config.num_hidden_layers,
            num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
            num_heads=config.num_attention_heads, hidden_size=config.hidden_size,
            eos_token_ids=config.eos_token_ids, bos_token_id=config.bos_token_id)

    @classmethod
    def from_pretrained(cls, model_path: str | Path, config: LlamaConfig, backend: Backend,
                        max_model_len: int | None = None) -> LlamaForCausalLM:
        return cls(config, backend, Checkpoint(model_path), max_model_len)

    def forward(self, batch: Any, kv_cache: list[KVLayer]) -> Any:
        """Logits ``[len(batch.logits_rows), vocab_size]`` for one step (any mix of prefill and decode)."""
        return self.stack.forward(self.backend, batch, kv_cache)
