"""The Qwen3.5 model: one ``forward`` for prefill, decode and mixed steps.

Every layer is ``x + mixer(norm(x))`` then ``x + mlp(norm(x))``; the mixer is either a Gated
DeltaNet (``linear_attention``, state in slots) or gated full attention (``full_attention``,
K/V in the paged pool). ``kv_cache_specs()`` declares one spec per layer, so ``kv_cache[i]`` is
layer i's cache::

    layer kinds (Qwen3.5-4B: 32 layers, every 4th is full attention)
    [GDN][GDN][GDN][ATTN][GDN][GDN][GDN][ATTN] ...
      │    │    │    └─ kv_cache[3]  KVLayer: paged blocks, the batch's block tables (FullAttentionSpec)
      └────┴────┴────── kv_cache[i]  StateLayer conv/ssm: engine-owned slots (RecurrentStateSpec),
                                     indexed by batch.state_slots

A sequence whose context starts at position 0 begins a fresh state, any other continues its
slot's state — so chunked prefill carries the state across chunks, and a prefix-cache hit
continues from the snapshot the engine restored into the slot. A step that snapshots a
sequence's state at a block boundary inside its rows (``batch.state_snapshots``) has its GDN
layers write that state in their one run where the plan's kernels can (``KernelPlan.
writes_snapshots``: the cuda chunked walk stores the state entering a chunk cut at the boundary),
else runs each GDN layer's core in two parts around the boundary (``state.split_at_snapshots``):
either way the prompt needs no step of its own for its last partial block.

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
    FullAttentionSpec,
    KVCacheSpec,
    KVLayer,
    ModelSpec,
    RotaryEmbedding,
    SingleRank,
    StateLayer,
    vocab_parallel_embedding,
    vocab_parallel_logits,
)
from openinfer_qwen35.config import FULL_ATTENTION, Qwen35Config
from openinfer_qwen35.kernel_plan import plan_for
from openinfer_qwen35.state import SnapshotSplit, StepSequences, split_at_snapshots, state_spec
from openinfer_qwen35.weights import DeltaNetWeights, FullAttentionWeights, Qwen35Weights

FEW_SNAPSHOTS = 2  # snapshots in a step up to which each slot is copied by a plain row copy


class Qwen35Model:
    """A ``openinfer.PagedModel`` whose GDN layers keep recurrent state in engine-owned slots."""

    def __init__(self, config: Qwen35Config, weights: Qwen35Weights, backend: Backend, *,
                 max_model_len: int, architectures: tuple[str, ...] = (), model_type: str = "qwen3_5_text",
                 comm: Communicator | None = None):
        self.config = config
        self.comm = comm or SingleRank()
        self.weights = weights
        self.backend = backend
        self.plan = plan_for(backend)
        if self.plan.warm_up is not None:
            self.plan.warm_up(config)
        self.rms_norm = self.plan.rms_norm or backend.rms_norm  # zero-centred: weights are 1 + w
        self.add_rms_norm = self.plan.add_rms_norm or backend.add_rms_norm
        rope = RotaryEmbedding.create(config.head_dim, config.rope, max_model_len, config.max_position_embeddings)
        # one spec per full-attention layer (its own q/k norms), in kv_cache order
        self.attention_specs = [
            AttentionSpec(num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
                          head_dim=config.head_dim, rope=rope, scale=config.head_dim**-0.5,
                          q_norm=layer.mixer.q_norm, k_norm=layer.mixer.k_norm, norm_eps=config.rms_norm_eps)
            for layer in weights.layers if isinstance(layer.mixer, FullAttentionWeights)]
        # per layer: ("attn", index into attention_specs) or ("gdn", index among the GDN layers)
        self.layer_slots: list[tuple[str, int]] = []
        for kind in config.layer_types:
            if kind == FULL_ATTENTION:
                self.layer_slots.append(("attn", sum(k == "attn" for k, _ in self.layer_slots)))
            else:
                self.layer_slots.append(("gdn", sum(k == "gdn" for k, _ in self.layer_slots)))
        kv_dtype = getattr(backend, "kv_dtype", "float32")
        attention = FullAttentionSpec(config.num_key_value_heads, config.head_dim, kv_dtype)
        state = state_spec(config, self.plan.conv_state_dtype)
        self._kv_cache_specs = [attention if kind == "attn" else state for kind, _ in self.layer_slots]
        self.spec = ModelSpec(
            architectures=architectures, model_type=model_type, vocab_size=config.vocab_size,
            max_model_len=max_model_len, num_layers=len(config.full_layer_ids),
            num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
            num_heads=config.num_attention_heads, hidden_size=config.hidden_size,
            eos_token_ids=config.eos_token_ids,
            extra={"recurrent_state": True})

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """One spec per layer: full attention K/V, or a GDN layer's conv + SSM state."""
        return list(self._kv_cache_specs)

    # --- forward ---------------------------------------------------------------------------------

    def forward(self, batch: ForwardBatch, kv_cache: list[KVLayer | StateLayer]) -> Any:
        ops, w = self.backend, self.weights
        seqs = self.plan.step_sequences(batch)
        split = None
        if seqs.snapshots is not None and not (self.plan.writes_snapshots is not None
                                               and self.plan.writes_snapshots(seqs, self.config)):
            split = split_at_snapshots(seqs)  # the kernels cannot write them: each GDN layer in two parts
            if self.plan.prepare_split is not None:
                split = self.plan.prepare_split(split)  # its arrays on the device, once a step
        comm = self.comm
        if w.vocab is None:
            hidden = ops.embedding(w.embed_tokens, batch.token_ids)
        else:
            hidden = vocab_parallel_embedding(ops, w.embed_tokens, batch.token_ids, w.vocab, comm)
        residual = None
        for layer, (kind, index), cache in zip(w.layers, self.layer_slots, kv_cache, strict=True):
            if residual is None:
                residual = hidden
                x = self.rms_norm(hidden, layer.input_norm, self.config.rms_norm_eps)
            else:
                x, residual = self.add_rms_norm(hidden, residual, layer.input_norm, self.config.rms_norm_eps)
            if kind == "attn":
                hidden = self._full_attention(x, layer.mixer, self.attention_specs[index], cache, batch)
            else:
                hidden = self._delta_net(x, layer.mixer, cache, seqs, split)
            hidden = comm.all_reduce(hidden)
            x, residual = self.add_rms_norm(hidden, residual, layer.post_attention_norm, self.config.rms_norm_eps)
            hidden = comm.all_reduce(ops.linear(ops.silu_mul(ops.linear(x, layer.gate_up)), layer.down))
        last = ops.gather_rows(ops.add(hidden, residual), batch.logits_rows)
        normed = self.rms_norm(last, w.final_norm, self.config.rms_norm_eps)
        if w.vocab is None:
            return ops.linear(normed, w.lm_head)
        return vocab_parallel_logits(ops, normed, w.lm_head, self.config.vocab_size, comm)

    def _full_attention(self, x: Any, w: FullAttentionWeights, spec: AttentionSpec, kv: KVLayer,
                        batch: Any) -> Any:
        qkv_gate = self.backend.linear(x, w.qkv_gate)  # [q | k | v | gate]
        qkv_size = spec.q_size + 2 * spec.kv_size
        context = self.backend.attention(qkv_gate[:, :qkv_size], spec, kv, batch)
        return self.backend.linear(self.plan.sigmoid_mul(context, qkv_gate[:, qkv_size:]), w.o_proj)

    def _delta_net(self, x: Any, w: DeltaNetWeights, state: StateLayer, seqs: StepSequences,
                   split: SnapshotSplit | None = None) -> Any:
        proj = self.backend.linear(x, w.in_proj)  # [q | k | v | z | b | a]
        if split is None:
            core = self.plan.delta_net(proj, w, state["conv"], state["ssm"], seqs, self.config)
        else:
            core = self._delta_net_snapshotting(proj, w, state, split)
        return self.backend.linear(core, w.out_proj)

    def _delta_net_snapshotting(self, proj: Any, w: DeltaNetWeights, state: StateLayer, split: SnapshotSplit) -> Any:
        """The layer core with snapshots inside sequences: the rows before each boundary, the
        slots copied into the snapshot slots, the rows after (``SnapshotSplit``), each part
        written into its rows of one output."""
        xp, conv, ssm, config = self.backend.xp, state["conv"], state["ssm"], self.config
        rows = proj if split.order is None else proj[split.order]
        core = xp.empty((rows.shape[0], config.linear_value_dim), dtype=proj.dtype)
        head = split.num_head_rows
        self.plan.delta_net(rows[:head], w, conv, ssm, split.head, config, out=core[:head])
        if self.plan.copy_state_rows is not None and len(split.pairs) <= FEW_SNAPSHOTS:
            self.plan.copy_state_rows([conv, ssm], split.pairs)
        elif len(split.pairs) <= FEW_SNAPSHOTS:  # a row copy each, no gather + scatter
            for live, snapshot in split.pairs:
                conv[snapshot] = conv[live]
                ssm[snapshot] = ssm[live]
        else:
            conv[split.snapshot] = conv[split.live]
            ssm[split.snapshot] = ssm[split.live]
        self.plan.delta_net(rows[head:], w, conv, ssm, split.tail, config, out=core[head:])
        return core if split.inverse is None else core[split.inverse]
