"""The DeepSeek-V4 model: one ``forward`` for prefill, decode and mixed steps (NumPy reference).

    ids ──embed──► H [T, hc, D] (hc copies)
      per layer:  x, mix = collapse(H, hc_attn)   y = attention(attn_norm(x))   H = expand(H, y, mix)
                  x, mix = collapse(H, hc_ffn)    y = moe(ffn_norm(x), ids)     H = expand(H, y, mix)
    logits = head(norm(collapse_head(H)))          (only the rows the engine samples)

Attention state is per request (``state.RequestStates``): the engine passes
``batch.request_ids``; a sequence whose context starts at position 0 begins a fresh state, any
other continues its request's state, so chunked prefill and decode carry the sliding window,
the compressed entries and each compressor's open window across steps. ``release_request``
drops a request's state (finished, aborted, failed or preempted — a preempted request is
recomputed from position 0).
"""

from __future__ import annotations

import numpy as np

from openinfer import Backend, ForwardBatch, KVLayer, ModelSpec, OpenInferError
from openinfer_deepseek_v4 import attention as attn
from openinfer_deepseek_v4.config import SLIDING, DeepseekV4Config
from openinfer_deepseek_v4.hyper_connection import collapse, collapse_head, expand
from openinfer_deepseek_v4.moe import moe
from openinfer_deepseek_v4.rotary import InterleavedRope
from openinfer_deepseek_v4.state import RequestState, RequestStates
from openinfer_deepseek_v4.weights import DeepseekV4Weights


class DeepseekV4Model:
    """An ``openinfer.PagedModel`` with per-request attention state (``release_request``)."""

    def __init__(self, config: DeepseekV4Config, weights: DeepseekV4Weights, backend: Backend, *,
                 max_model_len: int, max_requests: int = 256, architectures: tuple[str, ...] = (),
                 model_type: str = "deepseek_v4"):
        if backend.name != "numpy":
            raise OpenInferError("the DeepSeek-V4 plugin runs on the NumPy backend only (device=cpu); "
                                 "its CUDA kernels are not written yet")
        self.config = config
        self.weights = weights
        self.backend = backend
        self.states = RequestStates(config, max_requests)
        self.rope_main = InterleavedRope.create(config.rope_main, config.rope_head_dim)
        self.rope_compress = InterleavedRope.create(config.rope_compress, config.rope_head_dim)
        self.spec = ModelSpec(
            architectures=architectures, model_type=model_type, vocab_size=config.vocab_size,
            max_model_len=max_model_len, num_layers=0, num_kv_heads=1, head_dim=config.head_dim,
            num_heads=config.num_attention_heads, hidden_size=config.hidden_size,
            eos_token_ids=config.eos_token_ids, bos_token_id=config.bos_token_id,
            extra={"recurrent_state": True})

    # --- engine hooks ----------------------------------------------------------------------------

    def release_request(self, request_id: str) -> None:
        self.states.release(request_id)

    # --- forward ---------------------------------------------------------------------------------

    def forward(self, batch: ForwardBatch, kv_cache: list[KVLayer] | None = None) -> np.ndarray:
        c, w, ops = self.config, self.weights, self.backend
        token_ids = np.asarray(batch.token_ids)
        positions = np.asarray(batch.positions, np.int64)
        bounds = np.asarray(batch.query_start, np.int64)
        request_ids = tuple(batch.request_ids)
        if len(request_ids) != batch.num_seqs:
            raise OpenInferError("DeepSeek-V4 keeps per-request attention state: the engine must pass "
                                 "ForwardBatch.request_ids, one per sequence")
        states: list[RequestState] = [
            self.states.begin_or_continue(rid, int(positions[bounds[i]]))
            for i, rid in enumerate(request_ids)]

        embedded = np.asarray(ops.embedding(w.embed, token_ids), np.float32)
        streams = np.repeat(embedded[:, None, :], c.hc_mult, axis=1)
        mixing_args = {"hc_eps": c.hc_eps, "sinkhorn_iters": c.hc_sinkhorn_iters, "norm_eps": c.rms_norm_eps}
        for index, layer in enumerate(w.layers):
            x, mixing = collapse(streams, layer.hc_attn, **mixing_args)
            x = ops.rms_norm(x, layer.attn_norm, c.rms_norm_eps)
            rope = self.rope_main if c.layer_types[index] == SLIDING else self.rope_compress
            y = np.empty((x.shape[0], c.hidden_size), np.float32)
            for seq, state in enumerate(states):
                rows = slice(int(bounds[seq]), int(bounds[seq + 1]))
                y[rows] = attn.attention(ops, x[rows], positions[rows], layer.attn, state.layers[index], rope,
                                         num_heads=c.num_attention_heads, head_dim=c.head_dim,
                                         window=c.sliding_window, eps=c.rms_norm_eps)
            streams = expand(streams, y, mixing)
            x, mixing = collapse(streams, layer.hc_ffn, **mixing_args)
            x = ops.rms_norm(x, layer.ffn_norm, c.rms_norm_eps)
            y = moe(ops, x, token_ids, layer.ffn, top_k=c.num_experts_per_tok, scoring=c.scoring_func,
                    routed_scaling=c.routed_scaling_factor, swiglu_limit=c.swiglu_limit)
            streams = expand(streams, y, mixing)
        for seq, state in enumerate(states):
            state.num_tokens += int(bounds[seq + 1] - bounds[seq])

        rows = np.asarray(batch.logits_rows, np.int64)
        if rows.size == 0:  # a prefill chunk that samples nothing
            return np.zeros((0, c.vocab_size), np.float32)
        hidden = collapse_head(streams[rows], w.hc_head, hc_eps=c.hc_eps, norm_eps=c.rms_norm_eps)
        return ops.linear(ops.rms_norm(hidden, w.norm, c.rms_norm_eps), w.head)
