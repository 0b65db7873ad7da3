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
all-reduce sums the experts' shares (``openinfer.parallel.expert``). With data-parallel attention
(``rank.layout.attention_data_parallel``) each rank instead runs attention for its own sequences and
caches only their latent rows; the MoE then gathers every rank's tokens (``openinfer.parallel.data``).
"""

from __future__ import annotations

from typing import Any

from openinfer import (
    Backend,
    ForwardBatch,
    KVLayer,
    MLALatentSpec,
    ModelSpec,
    RankContext,
    RotaryEmbedding,
    expert_parallel_moe,
    expert_parallel_moe_sharded,
)
from openinfer.mla import MLASpec
from openinfer.moe import MoEWeights
from openinfer.parallel import DataParallelAttention
from openinfer_kimi_k2.config import KimiK2Config
from openinfer_kimi_k2.kernel_plan import plan_for
from openinfer_kimi_k2.weights import KimiK2Weights, LayerWeights, mla_spec


class KimiK2Model:
    """A ``openinfer.PagedModel``: the engine allocates one latent KV layer per decoder layer."""

    def __init__(self, config: KimiK2Config, weights: KimiK2Weights, backend: Backend, *, max_model_len: int,
                 architectures: tuple[str, ...] = ("DeepseekV3ForCausalLM",), num_parameters: int = 0,
                 rank: RankContext | None = None):
        self.config = config
        self.rank = rank or RankContext()
        self.data_parallel_attention = (DataParallelAttention(self.rank.comm)
                                        if self.rank.layout.attention_data_parallel else None)
        self.weights = weights
        self.backend = backend
        self.plan = plan_for(backend)
        self.mla: MLASpec = mla_spec(config)
        self.rope = RotaryEmbedding.create(config.qk_rope_head_dim, config.rope, max_model_len,
                                           config.max_position_embeddings)
        self.spec = ModelSpec(
            architectures=architectures, model_type=config.model_type, vocab_size=config.vocab_size,
            max_model_len=max_model_len, num_layers=config.num_hidden_layers,
            # one latent row per token (``kv_cache_specs``); as legacy K/V sizes: 1 head of 576
            num_kv_heads=1, head_dim=config.latent_dim, num_heads=config.num_attention_heads,
            hidden_size=config.hidden_size, eos_token_ids=config.eos_token_ids, bos_token_id=config.bos_token_id,
            num_parameters=num_parameters)

    def kv_cache_specs(self) -> list[MLALatentSpec]:
        """Every layer caches one latent row (c_kv | k_pe) per token: a single MLA group."""
        dtype = getattr(self.backend, "kv_dtype", "float32")
        return [MLALatentSpec(self.config.latent_dim, dtype)] * self.config.num_hidden_layers

    def forward(self, batch: ForwardBatch, kv_cache: list[KVLayer]) -> Any:
        ops, eps, plan, c = self.backend, self.config.rms_norm_eps, self.plan, self.config
        data_parallel = self.data_parallel_attention
        step = data_parallel.split(batch) if data_parallel is not None else None
        if step is not None:
            batch = step.batch  # this rank's sequences, its own block ids
        x = ops.embedding(self.weights.embed_tokens, batch.token_ids)
        residual, normed = None, None  # normed: this layer's (h, residual) when the last MoE fused its norm
        layers = self.weights.layers
        for index, (layer, kv) in enumerate(zip(layers, kv_cache, strict=True)):
            if normed is not None:
                (h, residual), normed = normed, None
            elif residual is None:
                residual, h = x, ops.rms_norm(x, layer.input_norm, eps)
            else:
                h, residual = ops.add_rms_norm(x, residual, layer.input_norm, eps)
            prefetch = plan.start_prefetch(ops, layer.mlp) if step is None and self.rank.expert.size == 1 else None
            w = layer.attention
            attn = plan.attention(ops, plan.linear(ops, h, w.qkv_a), w, kv, batch, self.mla, self.rope,
                                  c.q_lora_rank, eps)
            attn = plan.linear(ops, attn, w.o_proj)
            local_moe = isinstance(layer.mlp, MoEWeights) and step is None and self.rank.expert.size == 1
            next_norm = layers[index + 1].input_norm if index + 1 < len(layers) else None
            h, residual = ops.add_rms_norm(attn, residual, layer.post_attention_norm, eps)
            if local_moe and next_norm is not None:
                normed = plan.moe_add_norm(ops, h, layer.mlp, batch, residual, next_norm, eps)
            if normed is None:
                x = self._mlp(h, layer, batch)
            plan.join_prefetch(prefetch)
        x = ops.gather_rows(x, batch.logits_rows)
        residual = ops.gather_rows(residual, batch.logits_rows)
        h, _ = ops.add_rms_norm(x, residual, self.weights.final_norm, eps)
        logits = plan.linear(ops, h, self.weights.lm_head)
        return logits if step is None else data_parallel.gather_logits(step, logits)

    def _mlp(self, h: Any, layer: LayerWeights, batch: ForwardBatch) -> Any:
        ops, plan = self.backend, self.plan
        if isinstance(layer.mlp, MoEWeights):
            if self.data_parallel_attention is not None:
                return expert_parallel_moe_sharded(ops, h, layer.mlp, batch.token_ids, self.rank.comm,
                                                   self.rank.expert.experts(self.config.n_routed_experts))
            if self.rank.expert.size > 1:
                return expert_parallel_moe(ops, h, layer.mlp, batch.token_ids, self.rank.comm,
                                           self.rank.expert.experts(self.config.n_routed_experts))
            return plan.moe(ops, h, layer.mlp, batch)
        return plan.linear(ops, ops.silu_mul(plan.linear(ops, h, layer.mlp.gate_up)), layer.mlp.down)
