"""The Kimi-K2 / DeepSeek-V3 model: one ``forward`` for prefill, decode and mixed steps.

Each layer is ``x + MLA(norm(x))`` then ``x + MLP(norm(x))``; the MLP is a dense SwiGLU for the
first ``first_k_dense_replace`` layers and a routed MoE (+ shared experts) after::

    h ─► qkv_a ─┬─ q_a ─► rms(q_a_layernorm) ─► q_b ─► q [T, H, nope | rope]   (RoPE on rope)
                └─ kv_a ─┬─ c_kv ─► rms(kv_a_layernorm) ─┐
                         └─ k_pe ─► RoPE ────────────────┴─► latent [T, 576] ─► paged latent cache
    q, latent cache ─► MLA (naive for prefill, absorbed for decode) ─► o_proj

The paged cache holds one latent row per token and layer (``openinfer.mla``).

Expert parallel (``rank.expert``): each rank holds its slice of the routed experts; attention
and the dense layers are replicated, so every rank routes the same tokens the same way and one
all-reduce sums the experts' shares (``openinfer.parallel.expert``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from openinfer import (
    Backend,
    ForwardBatch,
    KVLayer,
    ModelSpec,
    RankContext,
    RotaryEmbedding,
    expert_parallel_moe,
)
from openinfer.mla import MLASpec, mla_attention, rotate_half_rope
from openinfer.moe import MoEWeights, moe_forward
from openinfer_kimi_k2.config import KimiK2Config
from openinfer_kimi_k2.weights import KimiK2Weights, LayerWeights, MLAAttentionWeights, mla_spec


class KimiK2Model:
    """A ``openinfer.PagedModel``: the engine allocates one latent KV layer per decoder layer."""

    def __init__(self, config: KimiK2Config, weights: KimiK2Weights, backend: Backend, *, max_model_len: int,
                 architectures: tuple[str, ...] = ("DeepseekV3ForCausalLM",), num_parameters: int = 0,
                 rank: RankContext | None = None):
        self.config = config
        self.rank = rank or RankContext()
        self.weights = weights
        self.backend = backend
        self.mla: MLASpec = mla_spec(config)
        self.rope = RotaryEmbedding.create(config.qk_rope_head_dim, config.rope, max_model_len,
                                           config.max_position_embeddings)
        self.spec = ModelSpec(
            architectures=architectures, model_type=config.model_type, vocab_size=config.vocab_size,
            max_model_len=max_model_len, num_layers=config.num_hidden_layers,
            # one latent row per token: the engine's per-layer KV is [blocks, block_size, 1, 576]
            num_kv_heads=1, head_dim=config.latent_dim, num_heads=config.num_attention_heads,
            hidden_size=config.hidden_size, eos_token_ids=config.eos_token_ids, bos_token_id=config.bos_token_id,
            num_parameters=num_parameters)

    def forward(self, batch: ForwardBatch, kv_cache: list[KVLayer]) -> Any:
        ops, eps = self.backend, self.config.rms_norm_eps
        x = ops.embedding(self.weights.embed_tokens, batch.token_ids)
        residual = None
        cos, sin = self.rope.cos[batch.positions], self.rope.sin[batch.positions]
        for layer, kv in zip(self.weights.layers, kv_cache, strict=True):
            if residual is None:
                residual, h = x, ops.rms_norm(x, layer.input_norm, eps)
            else:
                h, residual = ops.add_rms_norm(x, residual, layer.input_norm, eps)
            attn = self._attention(h, layer.attention, kv, batch, cos, sin)
            h, residual = ops.add_rms_norm(attn, residual, layer.post_attention_norm, eps)
            x = self._mlp(h, layer, batch)
        x = ops.gather_rows(x, batch.logits_rows)
        residual = ops.gather_rows(residual, batch.logits_rows)
        h, _ = ops.add_rms_norm(x, residual, self.weights.final_norm, eps)
        return ops.linear(h, self.weights.lm_head)

    def _attention(self, h: Any, w: MLAAttentionWeights, kv: KVLayer, batch: ForwardBatch,
                   cos: np.ndarray, sin: np.ndarray) -> Any:
        ops, c, spec = self.backend, self.config, self.mla
        num_tokens = h.shape[0]
        qkv_a = ops.linear(h, w.qkv_a)
        if c.q_lora_rank:
            q = ops.linear(ops.rms_norm(qkv_a[:, : c.q_lora_rank], w.q_a_norm, c.rms_norm_eps), w.q_b)
            latent = qkv_a[:, c.q_lora_rank:]
        else:
            q, latent = qkv_a[:, : -c.latent_dim], qkv_a[:, -c.latent_dim:]
        q = q.reshape(num_tokens, spec.num_heads, spec.qk_head_dim)
        q = np.concatenate([q[..., : spec.qk_nope_dim], rotate_half_rope(q[..., spec.qk_nope_dim:], cos, sin)], -1)
        c_kv = ops.rms_norm(latent[:, : spec.kv_lora_rank], w.kv_a_norm, c.rms_norm_eps)
        k_pe = rotate_half_rope(latent[:, None, spec.kv_lora_rank:], cos, sin)[:, 0]
        latents = np.concatenate([c_kv, k_pe], axis=-1)
        cache = kv.k.reshape(kv.k.shape[0], kv.k.shape[1], spec.latent_dim)
        out = mla_attention(q, latents, cache, w.mla, spec, batch)
        return ops.linear(out, w.o_proj)

    def _mlp(self, h: Any, layer: LayerWeights, batch: ForwardBatch) -> Any:
        ops = self.backend
        if isinstance(layer.mlp, MoEWeights):
            if self.rank.expert.size > 1:
                return expert_parallel_moe(ops, h, layer.mlp, batch.token_ids, self.rank.comm,
                                           self.rank.expert.experts(self.config.n_routed_experts))
            return moe_forward(ops, h, layer.mlp, batch.token_ids)
        return ops.linear(ops.silu_mul(ops.linear(h, layer.mlp.gate_up)), layer.mlp.down)
