"""The DeepSeek-V4 model: one ``forward`` for prefill, decode and mixed steps (the NumPy reference
below; on the cuda backend ``cuda_model.CudaForward`` runs the same steps).

    ids ──embed──► H [T, hc, D] (hc copies)
      per layer:  x, mix = collapse(H, hc_attn)   y = attention(attn_norm(x))   H = expand(H, y, mix)
                  x, mix = collapse(H, hc_ffn)    y = moe(ffn_norm(x), ids)     H = expand(H, y, mix)
    logits = head(norm(collapse_head(H)))          (only the rows the engine samples)

What attention keeps between steps is declared as KV cache specs (``state.kv_cache_specs``):
the sliding window and the compressed entries (and the indexer's keys) in paged blocks, each
compressor's open window in a state slot. The engine owns all of it — block tables, state
slots, prefix-cache snapshots, preemption — and ``forward`` reads and writes through the
batch's per-group block tables and ``state_slots``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from openinfer import (
    Backend,
    ForwardBatch,
    KVCacheSpec,
    ModelSpec,
    OpenInferError,
    RankContext,
    expert_parallel_moe,
)
from openinfer.moe import moe_forward
from openinfer_deepseek_v4 import attention as attn
from openinfer_deepseek_v4.config import SLIDING, DeepseekV4Config
from openinfer_deepseek_v4.hyper_connection import collapse, collapse_head, expand
from openinfer_deepseek_v4.kernel_plan import SUPPORTED_BACKENDS
from openinfer_deepseek_v4.rotary import InterleavedRope
from openinfer_deepseek_v4.state import SequenceLayerCache, kv_cache_specs
from openinfer_deepseek_v4.weights import DeepseekV4Weights


class DeepseekV4Model:
    """An ``openinfer.PagedModel`` declaring its caches (``kv_cache_specs``)."""

    def __init__(self, config: DeepseekV4Config, weights: DeepseekV4Weights, backend: Backend, *,
                 max_model_len: int, architectures: tuple[str, ...] = (),
                 model_type: str = "deepseek_v4", rank: RankContext | None = None):
        if backend.name not in SUPPORTED_BACKENDS:
            raise OpenInferError(f"the DeepSeek-V4 plugin runs on {SUPPORTED_BACKENDS} only, not {backend.name!r}")
        self.config = config
        self.rank = rank or RankContext()  # expert parallel: this rank's experts, summed over ranks
        self.weights = weights
        self.backend = backend
        self._specs, self.cache_index = kv_cache_specs(config, getattr(backend, "kv_dtype", "float32"))
        self.rope_main = InterleavedRope.create(config.rope_main, config.rope_head_dim)
        self.rope_compress = InterleavedRope.create(config.rope_compress, config.rope_head_dim)
        self.spec = ModelSpec(
            architectures=architectures, model_type=model_type, vocab_size=config.vocab_size,
            max_model_len=max_model_len, num_layers=len(self._specs), num_kv_heads=1, head_dim=config.head_dim,
            num_heads=config.num_attention_heads, hidden_size=config.hidden_size,
            eos_token_ids=config.eos_token_ids, bos_token_id=config.bos_token_id)
        self._cuda_forward = None
        if backend.name == "cuda":  # every token of a step at once, graph-capturable (cuda_model)
            from openinfer_deepseek_v4.cuda_model import CudaForward

            self._cuda_forward = CudaForward(self, max_model_len)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return list(self._specs)

    # --- forward ---------------------------------------------------------------------------------

    def forward(self, batch: ForwardBatch, kv_cache: list[Any]) -> Any:
        if self._cuda_forward is not None:
            return self._cuda_forward(batch, kv_cache)
        c, w, ops = self.config, self.weights, self.backend
        token_ids = np.asarray(batch.token_ids)
        positions = np.asarray(batch.positions, np.int64)
        bounds = np.asarray(batch.query_start, np.int64)
        if len(kv_cache) != len(self._specs) or len(batch.state_slots) != batch.num_seqs:
            raise OpenInferError("DeepSeek-V4 needs one cache per kv_cache_specs() entry and a state slot per "
                                 "sequence (ForwardBatch.state_slots)")
        starts = [int(positions[bounds[i]]) for i in range(batch.num_seqs)]

        embedded = np.asarray(ops.embedding(w.embed, token_ids), np.float32)
        streams = np.repeat(embedded[:, None, :], c.hc_mult, axis=1)
        mixing_args = {"hc_eps": c.hc_eps, "sinkhorn_iters": c.hc_sinkhorn_iters, "norm_eps": c.rms_norm_eps}
        for index, layer in enumerate(w.layers):
            x, mixing = collapse(streams, layer.hc_attn, **mixing_args)
            x = ops.rms_norm(x, layer.attn_norm, c.rms_norm_eps)
            rope = self.rope_main if c.layer_types[index] == SLIDING else self.rope_compress
            y = np.empty((x.shape[0], c.hidden_size), np.float32)
            for seq, start in enumerate(starts):
                rows = slice(int(bounds[seq]), int(bounds[seq + 1]))
                cache = SequenceLayerCache(kv_cache, self.cache_index[index], batch, seq, start)
                y[rows] = attn.attention(ops, x[rows], positions[rows], layer.attn, cache, rope,
                                         num_heads=c.num_attention_heads, head_dim=c.head_dim,
                                         window=c.sliding_window, eps=c.rms_norm_eps)
            streams = expand(streams, y, mixing)
            x, mixing = collapse(streams, layer.hc_ffn, **mixing_args)
            x = ops.rms_norm(x, layer.ffn_norm, c.rms_norm_eps)
            if self.rank.expert.size > 1:
                y = expert_parallel_moe(ops, x, layer.ffn, token_ids, self.rank.comm,
                                        self.rank.expert.experts(c.n_routed_experts))
            else:
                y = np.asarray(moe_forward(ops, x, layer.ffn, token_ids), np.float32)
            streams = expand(streams, y, mixing)

        rows = np.asarray(batch.logits_rows, np.int64)
        if rows.size == 0:  # a prefill chunk that samples nothing
            return np.zeros((0, c.vocab_size), np.float32)
        hidden = collapse_head(streams[rows], w.hc_head, hc_eps=c.hc_eps, norm_eps=c.rms_norm_eps)
        return ops.linear(ops.rms_norm(hidden, w.norm, c.rms_norm_eps), w.head)
