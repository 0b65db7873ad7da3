"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over a paged latent cache — NumPy reference.

Per token the cache holds one latent row of width ``kv_lora_rank + qk_rope_dim`` (512 + 64 = 576
for DeepSeek-V3/Kimi-K2), shared by all heads; there is no V::

    latent cache [num_blocks, block_size, 576]
                 ┌──────────── c_kv (RMS-normed, 512) ────────────┬─ k_pe (RoPE'd, 64) ─┐

``kv_b`` (``[H·(nope + v), kv_lora_rank]``) expands a latent into per-head keys and values. Two
equal ways to attend:

* **naive** (prefill): ``k_h = [c_kv·W_UK,hᵀ | k_pe]``, ``v_h = c_kv·W_UV,hᵀ``, then plain causal
  attention with ``q_h = [q_nope,h | q_pe,h]`` — cost grows with context × H × (nope + v);
* **absorbed** (decode): fold ``W_UK`` into the query, ``q̃_h = q_nope,h · W_UK,h`` (width 512), so
  ``score = (q̃_h · c_kv_t + q_pe,h · k_pe_t) · scale`` reads the 576-wide latents directly;
  ``o_h = W_UV,h · Σ_t p_t c_kv_t`` — cost grows with context × H × 576, no expansion per token.

Queries arrive with RoPE already applied to their ``q_pe`` part; new latents arrive RoPE'd too
and are written into the cache through ``slot_mapping`` before attending.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from openinfer.backend.base import ForwardBatch


@dataclass(frozen=True)
class MLASpec:
    """Static shape and scale of one MLA layer."""

    num_heads: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    kv_lora_rank: int
    scale: float  # qk_head_dim^-0.5, times YaRN's mscale² when the model uses it

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_dim + self.qk_rope_dim


@dataclass
class MLAWeights:
    """``kv_b`` split per head: ``w_uk [H, nope, lora]`` (keys), ``w_uv [H, v, lora]`` (values)."""

    w_uk: Any
    w_uv: Any

    @classmethod
    def from_kv_b(cls, kv_b: np.ndarray, spec: MLASpec) -> MLAWeights:
        per_head = kv_b.reshape(spec.num_heads, spec.qk_nope_dim + spec.v_head_dim, spec.kv_lora_rank)
        return cls(np.ascontiguousarray(per_head[:, : spec.qk_nope_dim]),
                   np.ascontiguousarray(per_head[:, spec.qk_nope_dim:]))


def write_latents(cache: np.ndarray, latents: np.ndarray, slot_mapping: np.ndarray) -> None:
    """Store new latent rows ``[T, latent_dim]`` at their slots of ``cache [blocks, block_size, latent_dim]``."""
    cache.reshape(-1, cache.shape[-1])[slot_mapping] = latents


def _context_latents(cache: np.ndarray, block_table: np.ndarray, length: int) -> np.ndarray:
    block_size = cache.shape[1]
    blocks = block_table[: -(-length // block_size)]
    return cache[blocks].reshape(-1, cache.shape[-1])[:length]


def _softmax_causal(scores: np.ndarray, num_new: int, length: int) -> np.ndarray:
    """Softmax over the last axis of ``scores [..., n, L]``; query i sits at position L − n + i."""
    if num_new > 1:
        query_pos = length - num_new + np.arange(num_new)
        mask = np.arange(length)[None, :] > query_pos[:, None]
        scores = np.where(mask, -np.inf, scores)
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def mla_naive(q: np.ndarray, context: np.ndarray, weights: MLAWeights, spec: MLASpec) -> np.ndarray:
    """Attention of ``q [n, H, nope+rope]`` over ``context [L, latent_dim]`` by expanding each
    latent into per-head keys and values; returns ``[n, H, v]``."""
    lora = spec.kv_lora_rank
    c_kv, k_pe = context[:, :lora], context[:, lora:]
    k_nope = np.einsum("tl,hdl->htd", c_kv, weights.w_uk)  # [H, L, nope]
    values = np.einsum("tl,hdl->htd", c_kv, weights.w_uv)  # [H, L, v]
    q_nope = q[..., : spec.qk_nope_dim].transpose(1, 0, 2)  # [H, n, nope]
    q_pe = q[..., spec.qk_nope_dim:].transpose(1, 0, 2)
    scores = (q_nope @ k_nope.transpose(0, 2, 1) + q_pe @ k_pe.T[None]) * spec.scale  # [H, n, L]
    probs = _softmax_causal(scores, q.shape[0], context.shape[0])
    return (probs @ values).transpose(1, 0, 2)


def mla_absorbed(q: np.ndarray, context: np.ndarray, weights: MLAWeights, spec: MLASpec) -> np.ndarray:
    """The same attention with ``W_UK`` folded into the query and ``W_UV`` applied after the
    weighted sum of latents; returns ``[n, H, v]``."""
    lora = spec.kv_lora_rank
    q_latent = np.einsum("nhd,hdl->hnl", q[..., : spec.qk_nope_dim], weights.w_uk)  # [H, n, lora]
    q_pe = q[..., spec.qk_nope_dim:].transpose(1, 0, 2)  # [H, n, rope]
    scores = (q_latent @ context[:, :lora].T + q_pe @ context[:, lora:].T) * spec.scale  # [H, n, L]
    probs = _softmax_causal(scores, q.shape[0], context.shape[0])
    latent_out = probs @ context[:, :lora]  # [H, n, lora]
    return np.einsum("hnl,hvl->nhv", latent_out, weights.w_uv)


def mla_attention(q: np.ndarray, latents: np.ndarray, cache: np.ndarray, weights: MLAWeights, spec: MLASpec,
                  batch: ForwardBatch) -> np.ndarray:
    """Write the step's latents, then attend each sequence over its whole context (cached +
    new): the naive form for prefill chunks, the absorbed form for single-token decode.
    ``q [T, H, nope+rope]`` → ``[T, H·v]``."""
    write_latents(cache, latents, batch.slot_mapping)
    out = np.empty((q.shape[0], spec.num_heads, spec.v_head_dim), np.float32)
    for i in range(batch.num_seqs):
        start, end = int(batch.query_start[i]), int(batch.query_start[i + 1])
        if end == start:
            continue
        context = _context_latents(cache, batch.block_tables[i], int(batch.context_lens[i]))
        attend = mla_absorbed if end - start == 1 else mla_naive
        out[start:end] = attend(q[start:end], context, weights, spec)
    return out.reshape(q.shape[0], spec.num_heads * spec.v_head_dim)


PREFILL_TILE = 64  # queries per block of the GPU's decompressed prefill kernel (mla.cu)
PREFILL_SEQ_FIELDS = 5  # table row, first query token, query count, context length, first context row


@dataclass(frozen=True)
class DecompressedPrefill:
    """The sequences of a step that a GPU runs in the decompressed form, laid out for mla.cu's
    ``mla_gather_context`` / ``mla_prefill_attention`` (int32 arrays)."""

    seqs: np.ndarray  # [S, PREFILL_SEQ_FIELDS]
    tile_seq: np.ndarray  # [tiles] row of ``seqs``; tiles with the most keys first
    tile_query: np.ndarray  # [tiles] first query of the tile (a multiple of the tile size)
    query_rows: np.ndarray  # the step's token rows of these sequences
    absorbed_rows: np.ndarray  # the step's other token rows
    context_rows: int  # their contexts' total length


def decompressed_prefill_layout(batch: ForwardBatch, spec: MLASpec, min_query: int,
                                scratch_bytes: int, tile: int = PREFILL_TILE) -> DecompressedPrefill | None:
    """Sequences bringing at least ``min_query`` new tokens, in batch order while their expanded
    keys and values (plus gathered latents) fit ``scratch_bytes`` (the first always); None if none.
    ``tile``: queries per tile (the kernel's block rows)."""
    counts = np.diff(batch.query_start)
    row_bytes = 2 * spec.num_heads * (spec.qk_nope_dim + spec.v_head_dim) + 2 * spec.latent_dim
    chosen: list[int] = []
    used = 0
    for s in np.flatnonzero(counts >= min_query):
        need = int(batch.context_lens[s]) * row_bytes
        if chosen and used + need > scratch_bytes:
            break
        chosen.append(int(s))
        used += need
    if not chosen:
        return None
    seqs = np.zeros((len(chosen), PREFILL_SEQ_FIELDS), np.int32)
    tile_seq, tile_query = [], []
    context_first = 0
    for i, s in enumerate(chosen):
        queries, context = int(counts[s]), int(batch.context_lens[s])
        seqs[i] = (s, batch.query_start[s], queries, context, context_first)
        context_first += context
        starts = np.arange(0, queries, tile)
        tile_seq.append(np.full(len(starts), i))
        tile_query.append(starts)
    all_seq, all_query = np.concatenate(tile_seq), np.concatenate(tile_query)
    keys = seqs[all_seq, 3] - seqs[all_seq, 2] + all_query  # keys the tile's first query sees, minus one
    order = np.argsort(-keys, kind="stable")
    query_rows = np.concatenate([np.arange(batch.query_start[s], batch.query_start[s + 1]) for s in chosen])
    taken = np.zeros(int(batch.query_start[-1]), bool)
    taken[query_rows] = True
    return DecompressedPrefill(seqs, all_seq[order].astype(np.int32), all_query[order].astype(np.int32),
                               query_rows.astype(np.int32), np.flatnonzero(~taken).astype(np.int32), context_first)


def rotate_half_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE of ``x [T, heads, rotary_dim]`` with per-token tables ``cos/sin [T, rotary_dim/2]``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
