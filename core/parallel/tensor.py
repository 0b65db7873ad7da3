"""Tensor-parallel pieces shared by the model families: slicing host weights per rank, the
vocab-parallel embedding and the vocab-parallel LM head.

Linear layers (``[out, in]`` rows, as HF stores them)::

    column-parallel  W[out_r, :]    each rank computes its output features; no communication
                     (qkv by heads, gate_up by intermediate rows, LM head by vocab rows)
    row-parallel     W[:, in_r]     each rank's partial sum over its input features, then one
                     all-reduce (o_proj, down); the bias is added on rank 0 only

Fused weights are split part by part and re-fused, so every rank's qkv is
``[q heads_r | k heads_r | v heads_r]`` and its gate_up ``[gate_r | up_r]``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from openinfer.parallel.communicator import Communicator, gather_last_axis
from openinfer.parallel.layout import TensorShard, VocabShard


def head_rows(weight: np.ndarray, heads: slice, head_dim: int) -> np.ndarray:
    """Rows (or bias entries) of the heads in ``heads`` from a ``[num_heads * head_dim, ...]`` tensor."""
    return weight[heads.start * head_dim: heads.stop * head_dim]


def column_rows(weight: np.ndarray, shard: TensorShard, what: str) -> np.ndarray:
    """Column-parallel: this rank's equal block of output rows (or of a bias vector)."""
    return weight[shard.split(weight.shape[0], what)]


def row_columns(weight: np.ndarray, shard: TensorShard, what: str) -> np.ndarray:
    """Row-parallel: this rank's equal block of input columns of ``[out, in]``."""
    return np.ascontiguousarray(weight[:, shard.split(weight.shape[1], what)])


def row_parallel_bias(bias: np.ndarray | None, shard: TensorShard) -> np.ndarray | None:
    """A row-parallel layer's bias, added once: on rank 0 only (the all-reduce sums the ranks)."""
    return bias if shard.rank == 0 else None


def vocab_rows(table: np.ndarray, vocab: VocabShard) -> np.ndarray:
    """Rows ``vocab.start..end`` of an embedding / LM-head table, zero-padded to ``padded_size``."""
    part = table[vocab.start: vocab.end]
    if part.shape[0] == vocab.padded_size:
        return part
    padded = np.zeros((vocab.padded_size, *table.shape[1:]), dtype=table.dtype)
    padded[: part.shape[0]] = part
    return padded


def vocab_parallel_embedding(ops: Any, table: Any, token_ids: Any, vocab: VocabShard, comm: Communicator) -> Any:
    """Each rank looks up the ids it holds (others read row 0 and are zeroed), then one
    all-reduce sums the parts: exactly one rank contributes each row. Graph-capturable: no
    host sync, elementwise ops only."""
    if comm.world_size == 1:
        return ops.embedding(table, token_ids)
    xp = ops.xp
    local = token_ids - vocab.start
    held = (local >= 0) & (local < vocab.num_rows)
    rows = ops.embedding(table, xp.where(held, local, 0).astype(xp.int32))
    # multiplying the stored values (fp32, or bf16 bits as uint16) by 0/1 keeps or zeroes a row exactly
    rows = rows * held.astype(rows.dtype)[:, None]
    return comm.all_reduce(rows)


def vocab_parallel_logits(ops: Any, hidden: Any, lm_head: Any, vocab_size: int, comm: Communicator) -> Any:
    """Each rank's logits for its vocab rows, all-gathered into ``[rows, vocab_size]`` on every
    rank (the padding columns of the last rank are dropped)."""
    local = ops.linear(hidden, lm_head)
    if comm.world_size == 1:
        return local
    full = gather_last_axis(comm, local, ops.xp)
    return full if full.shape[1] == vocab_size else ops.xp.ascontiguousarray(full[:, :vocab_size])
