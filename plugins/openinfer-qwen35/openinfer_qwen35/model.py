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

Tensor parallel: ``config`` is the rank's (``Qwen35Config.for_rank``: its attention, KV, GDN
key and value heads), the mixers' and the MLP's outputs are partial sums completed by one
all-reduce each over ``comm``, and the embedding / LM head hold the rank's vocab rows.
"""

from __future__ import annotations

from typing import Any

from openinfer import (
    AttentionSpec,
    Backend,
    Communicator,
    ForwardBatch,
    KVLayer,
    ModelSpec,
    OpenInferError,
    RotaryEmbedding,
    SingleRank,
    vocab_parallel_embedding,
    vocab_parallel_logits,
)
from openinfer_qwen35.config import FULL_ATTENTION, Qwen35Config
from openinfer_qwen35.kernel_plan import plan_for
from openinfer_qwen35.state import DeltaNetStateCache, StepSequences
from openinfer_qwen35.weights import DeltaNetWeights, FullAttentionWeights, Qwen35Weights


class Qwen35Model:
    """A ``openinfer.PagedModel`` with per-request recurrent state (``release_request``)."""

    def __init__(self, config: Qwen35Config, weights: Qwen35Weights, backend: Backend, *,
                 max_model_len: int, num_state_slots: int, architectures: tuple[str, ...] = (),
                 model_type: str = "qwen3_5_text", comm: Communicator | None = None):
        self.config = config
        self.comm = comm or SingleRank()
        self.weights = weights
        self.backend = backend
        self.plan = plan_for(backend)
        self.rms_norm = self.plan.rms_norm or backend.rms_norm  # zero-centred: weights are 1 + w
        self.add_rms_norm = self.plan.add_rms_norm or backend.add_rms_norm
        self.state = DeltaNetStateCache(config, num_state_slots, backend.xp, self.plan.conv_state_dtype)
        rope = RotaryEmbedding.create(config.head_dim, config.rope, max_model_len, config.max_position_embeddings)
        # one spec per full-attention layer (its own q/k norms), in kv_cache order
        self.attention_specs = [
            AttentionSpec(num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
                          head_dim=config.head_dim, rope=rope, scale=config.head_dim**-0.5,
                          q_norm=layer.mixer.q_norm, k_norm=layer.mixer.k_norm, norm_eps=config.rms_norm_eps)
            for layer in weights.layers if isinstance(layer.mixer, FullAttentionWeights)]
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
        seqs = self.plan.prepare_sequences(self._step_sequences(batch))
        comm = self.comm
        if w.vocab is None:
            hidden = ops.embedding(w.embed_tokens, batch.token_ids)
        else:
            hidden = vocab_parallel_embedding(ops, w.embed_tokens, batch.token_ids, w.vocab, comm)
        residual = None
        for layer, (kind, index) in zip(w.layers, self.layer_slots, strict=True):
            if residual is None:
                residual = hidden
                x = self.rms_norm(hidden, layer.input_norm, self.config.rms_norm_eps)
            else:
                x, residual = self.add_rms_norm(hidden, residual, layer.input_norm, self.config.rms_norm_eps)
            if kind == "attn":
                hidden = self._full_attention(x, layer.mixer, self.attention_specs[index], kv_cache[index], batch)
            else:
                hidden = self._delta_net(x, layer.mixer, index, seqs)
            hidden = comm.all_reduce(hidden)
            x, residual = self.add_rms_norm(hidden, residual, layer.post_attention_norm, self.config.rms_norm_eps)
            hidden = comm.all_reduce(ops.linear(ops.silu_mul(ops.linear(x, layer.gate_up)), layer.down))
        last = ops.gather_rows(ops.add(hidden, residual), batch.logits_rows)
        normed = self.rms_norm(last, w.final_norm, self.config.rms_norm_eps)
        if w.vocab is None:
            return ops.linear(normed, w.lm_head)
        return vocab_parallel_logits(ops, normed, w.lm_head, self.config.vocab_size, comm)

    def _step_sequences(self, batch: Any) -> StepSequences:
        host = getattr(batch, "host", None) or batch  # a device batch keeps its host ForwardBatch
        request_ids = getattr(host, "request_ids", ())
        if len(request_ids) != host.num_seqs:
            raise OpenInferError("Qwen3.5 keeps per-request recurrent state: the engine must pass "
                                 "ForwardBatch.request_ids, one per sequence")
        return self.state.step_sequences(tuple(request_ids), host.query_start, host.context_lens)

    def _full_attention(self, x: Any, w: FullAttentionWeights, spec: AttentionSpec, kv: KVLayer,
                        batch: Any) -> Any:
        qkv_gate = self.backend.linear(x, w.qkv_gate)  # [q | k | v | gate]
        qkv_size = spec.q_size + 2 * spec.kv_size
        context = self.backend.attention(qkv_gate[:, :qkv_size], spec, kv, batch)
        return self.backend.linear(self.plan.sigmoid_mul(context, qkv_gate[:, qkv_size:]), w.o_proj)

    def _delta_net(self, x: Any, w: DeltaNetWeights, index: int, seqs: StepSequences) -> Any:
        proj = self.backend.linear(x, w.in_proj)  # [q | k | v | z | b | a]
        core = self.plan.delta_net(proj, w, self.state.conv[index], self.state.ssm[index], seqs, self.config)
        return self.backend.linear(core, w.out_proj)
