"""The Qwen3.5 model: one ``forward`` for prefill, decode and mixed steps.

Every layer is ``x + mixer(norm(x))`` then ``x + mlp(norm(x))``; the mixer is either a Gated
DeltaNet (``linear_attention``, state in slots) or gated full attention (``full_attention``,
K/V in the paged pool)::

    layer kinds (Qwen3.5-4B: 32 layers, every 4th is full attention)
    [GDN][GDN][GDN][ATTN][GDN][GDN][GDN][ATTN] ...
      │    │    │    └─ kv_cache[0]        paged blocks, indexed by the batch's block tables
      └────┴────┴────── state.conv/ssm[0..2]  fixed slots, indexed by the request's slot

The engine passes ``batch.request_ids`` (one per sequence); a sequence whose context starts at
position 0 begins a fresh state, any other continues its slot's state — so chunked prefill
carries the state across chunks. ``release_request`` frees the slot when the engine drops a
request (finished, aborted or preempted).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from openinfer import (
    AttentionSpec,
    Backend,
    ForwardBatch,
    KVLayer,
    ModelSpec,
    OpenInferError,
    RotaryEmbedding,
)
from openinfer_qwen35.config import FULL_ATTENTION, Qwen35Config
from openinfer_qwen35.gated_deltanet import l2_normalize, sigmoid, softplus
from openinfer_qwen35.kernel_plan import plan_for
from openinfer_qwen35.state import DeltaNetStateCache
from openinfer_qwen35.weights import DeltaNetWeights, FullAttentionWeights, Qwen35Weights


class Qwen35Model:
    """A ``openinfer.PagedModel`` with per-request recurrent state (``release_request``)."""

    def __init__(self, config: Qwen35Config, weights: Qwen35Weights, backend: Backend, *,
                 max_model_len: int, num_state_slots: int, architectures: tuple[str, ...] = (),
                 model_type: str = "qwen3_5_text"):
        self.config = config
        self.weights = weights
        self.backend = backend
        self.plan = plan_for(backend)
        self.state = DeltaNetStateCache(config, num_state_slots)
        rope = RotaryEmbedding.create(config.head_dim, config.rope, max_model_len, config.max_position_embeddings)
        self.attention_spec = AttentionSpec(
            num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim, rope=rope, scale=config.head_dim**-0.5, norm_eps=config.rms_norm_eps)
        # per layer: ("attn", index into kv_cache) or ("gdn", index into state)
        self.layer_slots: list[tuple[str, int]] = []
        for kind in config.layer_types:
            if kind == FULL_ATTENTION:
                self.layer_slots.append(("attn", sum(k == "attn" for k, _ in self.layer_slots)))
            else:
                self.layer_slots.append(("gdn", sum(k == "gdn" for k, _ in self.layer_slots)))
        self.spec = ModelSpec(
            architectures=architectures, model_type=model_type, vocab_size=config.vocab_size,
            max_model_len=max_model_len, num_layers=len(config.full_layer_ids),
            num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
            num_heads=config.num_attention_heads, hidden_size=config.hidden_size,
            eos_token_ids=config.eos_token_ids,
            extra={"num_state_slots": num_state_slots, "recurrent_state": True})

    # --- engine hooks ----------------------------------------------------------------------------

    def release_request(self, request_id: str) -> None:
        """The engine dropped the request (finished, aborted, preempted): free its state slot."""
        self.state.release(request_id)

    # --- forward ---------------------------------------------------------------------------------

    def forward(self, batch: ForwardBatch, kv_cache: list[KVLayer]) -> Any:
        ops, w = self.backend, self.weights
        slots = self._state_slots(batch)
        hidden = ops.embedding(w.embed_tokens, batch.token_ids)
        residual = None
        for layer, (kind, index) in zip(w.layers, self.layer_slots, strict=True):
            if residual is None:
                residual = hidden
                x = ops.rms_norm(hidden, layer.input_norm, self.config.rms_norm_eps)
            else:
                x, residual = ops.add_rms_norm(hidden, residual, layer.input_norm, self.config.rms_norm_eps)
            if kind == "attn":
                hidden = self._full_attention(x, layer.mixer, kv_cache[index], batch)
            else:
                hidden = self._delta_net(x, layer.mixer, index, slots, batch)
            x, residual = ops.add_rms_norm(hidden, residual, layer.post_attention_norm, self.config.rms_norm_eps)
            hidden = ops.linear(ops.silu_mul(ops.linear(x, layer.gate_up)), layer.down)
        last = ops.gather_rows(ops.add(hidden, residual), batch.logits_rows)
        return ops.linear(ops.rms_norm(last, w.final_norm, self.config.rms_norm_eps), w.lm_head)

    def _state_slots(self, batch: ForwardBatch) -> np.ndarray:
        """Each sequence's state slot; a sequence starting at position 0 begins a zeroed one."""
        request_ids = getattr(batch, "request_ids", None)
        if request_ids is None or len(request_ids) != batch.num_seqs:
            raise OpenInferError("Qwen3.5 keeps per-request recurrent state: the engine must pass "
                                 "ForwardBatch.request_ids, one per sequence")
        query_lens = np.diff(np.asarray(batch.query_start))
        starts = np.asarray(batch.context_lens) - query_lens
        return np.asarray([self.state.begin(rid) if start == 0 else self.state.slot_of(rid)
                           for rid, start in zip(request_ids, starts.tolist(), strict=True)], np.int64)

    def _full_attention(self, x: Any, w: FullAttentionWeights, kv: KVLayer, batch: ForwardBatch) -> Any:
        spec = self.attention_spec
        spec = AttentionSpec(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.rope, spec.scale,
                             w.q_norm, w.k_norm, spec.norm_eps)
        qkv_gate = self.backend.linear(x, w.qkv_gate)  # [q | k | v | gate]; attention reads the first three
        context = self.backend.attention(qkv_gate, spec, kv, batch)
        gate = qkv_gate[:, spec.q_size + 2 * spec.kv_size :]
        return self.backend.linear(self.plan.sigmoid_mul(context, gate), w.o_proj)

    def _delta_net(self, x: Any, w: DeltaNetWeights, index: int, slots: np.ndarray, batch: ForwardBatch) -> Any:
        cfg, plan = self.config, self.plan
        conv_dim, value_dim, nv = cfg.conv_dim, cfg.linear_value_dim, cfg.linear_num_value_heads
        proj = self.backend.linear(x, w.in_proj)  # [q | k | v | z | b | a]
        mixed = proj[:, :conv_dim]
        z = proj[:, conv_dim : conv_dim + value_dim]
        beta = sigmoid(proj[:, conv_dim + value_dim : conv_dim + value_dim + nv])
        decay = w.neg_decay_rate * softplus(proj[:, conv_dim + value_dim + nv :] + w.dt_bias)  # g ≤ 0
        conv_state, ssm_state = self.state.conv[index], self.state.ssm[index]
        core = np.empty((x.shape[0], nv, cfg.linear_value_head_dim), np.float32)
        query_start = np.asarray(batch.query_start)
        query_lens = np.diff(query_start)

        decoding = np.flatnonzero(query_lens == 1)
        if decoding.size:
            rows, seq_slots = query_start[decoding], slots[decoding]
            conv_out, conv_state[seq_slots] = plan.causal_conv1d_step(mixed[rows], w.conv_weight,
                                                                      conv_state[seq_slots])
            q, k, v = self._split_heads(conv_out)
            core[rows], ssm_state[seq_slots] = plan.recurrent_gated_delta_rule_step(
                q, k, v, decay[rows], beta[rows], ssm_state[seq_slots])
        for seq in np.flatnonzero(query_lens > 1):
            start, end, slot = int(query_start[seq]), int(query_start[seq + 1]), int(slots[seq])
            conv_out, conv_state[slot] = plan.causal_conv1d(mixed[start:end], w.conv_weight, conv_state[slot])
            q, k, v = self._split_heads(conv_out)
            core[start:end], ssm_state[slot] = plan.chunk_gated_delta_rule(
                q, k, v, decay[start:end], beta[start:end], ssm_state[slot])

        dv = cfg.linear_value_head_dim
        normed = plan.gated_rms_norm(core.reshape(-1, dv), z.reshape(-1, dv), w.norm, cfg.rms_norm_eps)
        return self.backend.linear(normed.reshape(-1, value_dim), w.out_proj)

    def _split_heads(self, conv_out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``[n, q|k|v]`` → l2-normalised, scaled q and k repeated to the value heads, and v."""
        cfg = self.config
        n, nk, dk = conv_out.shape[0], cfg.linear_num_key_heads, cfg.linear_key_head_dim
        key_dim, repeat = cfg.linear_key_dim, cfg.linear_num_value_heads // nk
        q = l2_normalize(conv_out[:, :key_dim].reshape(n, nk, dk)) * np.float32(dk**-0.5)
        k = l2_normalize(conv_out[:, key_dim : 2 * key_dim].reshape(n, nk, dk))
        v = conv_out[:, 2 * key_dim :].reshape(n, cfg.linear_num_value_heads, cfg.linear_value_head_dim)
        if repeat > 1:
            q, k = np.repeat(q, repeat, axis=1), np.repeat(k, repeat, axis=1)
        return q, k, v
