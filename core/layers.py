"""Building blocks shared by decoder-only transformer plugins (Llama, Qwen3, ...).

A plugin maps its checkpoint onto these structures in its ``weights.py`` and composes them in
its ``model.py``; the math lives here once, written against backend ops.

Fused weights (rows of the ``[out, in]`` matrix)::

    qkv      [ q: num_heads*head_dim | k: num_kv_heads*head_dim | v: num_kv_heads*head_dim ]
    gate_up  [ gate: intermediate | up: intermediate ]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from openinfer.backend.base import AttentionSpec, Backend, KVLayer
from openinfer.parallel.communicator import Communicator, SingleRank
from openinfer.parallel.layout import VocabShard
from openinfer.parallel.tensor import vocab_parallel_embedding, vocab_parallel_logits

SINGLE_RANK = SingleRank()


def fuse_rows(*weights: np.ndarray) -> np.ndarray:
    """Stack ``[out_i, in]`` matrices (or bias vectors) into one fused ``[sum(out_i), in]``."""
    return np.concatenate(weights, axis=0)


def fused_linear_weight(ops: Backend, weights: Sequence[np.ndarray], biases: Sequence[np.ndarray] | None = None) -> Any:
    """``ops.linear_weight(fuse_rows(*weights), fuse_rows(*biases))``; a backend that can place
    the parts into the fused matrix itself (``fused_linear_weight``: CUDA, straight from the
    checkpoint's memory map) never builds the fused copy on the host."""
    place = getattr(ops, "fused_linear_weight", None)
    if place is not None:
        return place(list(weights), None if biases is None else list(biases))
    return ops.linear_weight(fuse_rows(*weights), None if biases is None else fuse_rows(*biases))


@dataclass
class DecoderLayer:
    """Pre-norm attention block + SwiGLU MLP, with the residual carried un-normed::

        h, residual = norm(x + residual)        (fused add + RMSNorm)
        x = o_proj(attention(qkv(h)))
        h, residual = norm(x + residual)
        x = down(silu(gate(h)) * up(h))

    Under tensor parallelism (``comm.world_size > 1``) each rank holds its heads' part of qkv,
    its rows of gate_up and the matching input columns of o_proj and down: the outputs of
    o_proj and down are partial sums, completed by one all-reduce each.

    Where the backend adds a GEMM's product into the residual in place (``linear_residual``:
    cuda, ``OPENINFER_RESIDUAL_GEMM=1``, one rank), o_proj and down write into the residual and
    the next norm reads it alone: ``forward`` then returns ``(None, residual)`` and the next
    layer's (or the stack's final) norm is a plain RMSNorm of the residual.
    """

    input_norm: Any
    qkv: Any
    attention: AttentionSpec
    o_proj: Any
    post_attention_norm: Any
    gate_up: Any
    down: Any

    def forward(self, ops: Backend, x: Any, residual: Any | None, kv: KVLayer, batch: Any,
                eps: float, comm: Communicator = SINGLE_RANK) -> tuple[Any, Any]:
        qkv, residual = norm_linear(ops, x, residual, self.input_norm, eps, self.qkv)
        attn = ops.attention(qkv, self.attention, kv, batch)
        if added_into_residual(ops, attn, self.o_proj, residual, comm):
            attn_out = None
        else:
            attn_out = comm.all_reduce(ops.linear(attn, self.o_proj))
        gate_up, residual = norm_linear(ops, attn_out, residual, self.post_attention_norm, eps, self.gate_up)
        if added_into_residual(ops, gate_up, self.down, residual, comm, silu_mul=True):
            return None, residual
        return comm.all_reduce(silu_mul_linear(ops, gate_up, self.down)), residual


def added_into_residual(ops: Backend, x: Any, layer: Any, residual: Any | None, comm: Communicator,
                        silu_mul: bool = False) -> bool:
    """``residual += linear(x)`` (``silu_mul``: of ``silu_mul(x)``) in place, where the backend
    does it in one GEMM (``linear_residual``) and the product is whole on this rank; False:
    nothing was done."""
    add = getattr(ops, "linear_residual", None)
    return add is not None and residual is not None and comm.world_size == 1 and add(x, layer, residual, silu_mul)


def norm_linear(ops: Backend, x: Any | None, residual: Any | None, norm_weight: Any, eps: float,
                layer: Any) -> tuple[Any, Any]:
    """``(linear(rms_norm(x + residual)), x + residual)``, or with no residual yet
    ``(linear(rms_norm(x)), x)``: one op where the backend fuses it (cuda decode rows). ``x``
    None: the residual already holds the sum (``added_into_residual``)."""
    if x is None:
        x, residual = residual, None
    fused = getattr(ops, "add_rms_norm_linear", None)
    if fused is not None:
        return fused(x, residual, norm_weight, eps, layer)
    if residual is None:
        return ops.linear(ops.rms_norm(x, norm_weight, eps), layer), x
    h, residual = ops.add_rms_norm(x, residual, norm_weight, eps)
    return ops.linear(h, layer), residual


def silu_mul_linear(ops: Backend, gate_up: Any, layer: Any) -> Any:
    """``linear(silu_mul(gate_up))``, fused where the backend fuses it."""
    fused = getattr(ops, "silu_mul_linear", None)
    return fused(gate_up, layer) if fused is not None else ops.linear(ops.silu_mul(gate_up), layer)


@dataclass
class DecoderStack:
    """Embedding → layers → final norm → LM head, computing logits only for ``batch.logits_rows``.

    Under tensor parallelism the embedding and LM head hold this rank's vocab rows (``vocab``):
    the embedding is all-reduced, the logits all-gathered, so every rank returns the full
    ``[rows, vocab_size]`` logits (rank 0's are sampled)."""

    embed_tokens: Any
    layers: Sequence[DecoderLayer]
    final_norm: Any
    lm_head: Any
    eps: float
    comm: Communicator = SINGLE_RANK
    vocab: VocabShard | None = None  # None: the whole vocabulary on this rank
    vocab_size: int = 0

    def forward(self, ops: Backend, batch: Any, kv_cache: Sequence[KVLayer]) -> Any:
        comm = self.comm
        if self.vocab is None:
            x = ops.embedding(self.embed_tokens, batch.token_ids)
        else:
            x = vocab_parallel_embedding(ops, self.embed_tokens, batch.token_ids, self.vocab, comm)
        residual = None
        for layer, kv in zip(self.layers, kv_cache, strict=True):
            x, residual = layer.forward(ops, x, residual, kv, batch, self.eps, comm)
        residual = ops.gather_rows(residual, batch.logits_rows)
        if x is None:  # the last layer added its output into the residual
            h = ops.rms_norm(residual, self.final_norm, self.eps)
        else:
            h, _ = ops.add_rms_norm(ops.gather_rows(x, batch.logits_rows), residual, self.final_norm, self.eps)
        if self.vocab is None:
            return ops.linear(h, self.lm_head)
        return vocab_parallel_logits(ops, h, self.lm_head, self.vocab_size, comm)


def eos_token_ids_from(config: dict[str, Any], generation_config: dict[str, Any] | None = None) -> tuple[int, ...]:
    """EOS ids from config.json and generation_config.json (either may hold an int or a list)."""
    ids: list[int] = []
    for source in (config, generation_config or {}):
        value = source.get("eos_token_id")
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return tuple(ids)
