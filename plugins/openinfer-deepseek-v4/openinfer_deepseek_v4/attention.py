"""DeepSeek-V4 attention (NumPy reference): sliding window + compressed entries, sinks, K = V.

Per sequence, for the step's new tokens at positions ``t0 … t0+n-1``::

    qr = q_norm(wq_a x)          q = rms(wq_b qr) per head, RoPE on the last rope_dim channels
    kv = RoPE(kv_norm(wkv x))    one head; the same vector is the key and the value
    keys(t) = window: the last W tokens up to t   (positions t-W+1 … t)
            + compressed entries w with  w < (t+1) // m
                HCA: all of them;  CSA: those the indexer puts in its top-k for t
    p = softmax([q·k / √D …, sink_h])  (the sink only enlarges the denominator)
    o = RoPE⁻¹(Σ p·k)  at t,  then  wo_b(concat_g wo_a[g] @ o_g)   (grouped low-rank output)

Compressor (entry w of rate m, over the window's tokens j): ``Σ_j softmax_j(wgate x_j + ape[j])
⊙ wkv x_j`` per channel, then RMSNorm and RoPE at position w·m. CSA overlaps: its projections
are [Ca | Cb] (2·D wide) and entry w pools Cb of window w plus Ca of window w−1 (2m slots).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from openinfer_deepseek_v4.rotary import InterleavedRope
from openinfer_deepseek_v4.state import COMPRESSOR, INDEXER, OpenWindow, SequenceLayerCache
from openinfer_deepseek_v4.weights import AttentionWeights, CompressorWeights, IndexerWeights


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    x = np.asarray(x, np.float32)
    normed = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))
    return normed if weight is None else normed * weight


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    shifted = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return shifted / np.sum(shifted, axis=axis, keepdims=True)


def compress(ops: Any, x: np.ndarray, w: CompressorWeights, window: OpenWindow, first_entry: int,
             rope: InterleavedRope, eps: float) -> tuple[np.ndarray, OpenWindow]:
    """Feed ``x`` [n, hidden] (a sequence's next tokens) to a compressor whose open window is
    ``window`` and whose next entry is ``first_entry``: ``(entries of the windows that close,
    the open window after x)``."""
    kv = np.concatenate([window.kv, ops.linear(x, w.wkv)])
    gate = np.concatenate([window.gate, ops.linear(x, w.wgate)])
    m, d = w.ratio, w.head_dim
    usable = (kv.shape[0] // m) * m
    after = OpenWindow(kv[usable:], gate[usable:], window.overlap_kv, window.overlap_gate)
    if usable == 0:
        return np.zeros((0, d), np.float32), after
    windows = usable // m
    kv = kv[:usable].reshape(windows, m, -1)
    gate = gate[:usable].reshape(windows, m, -1) + w.ape
    if w.overlap:
        slots_kv = np.zeros((windows, 2 * m, d), np.float32)
        slots_gate = np.full((windows, 2 * m, d), -np.inf, np.float32)
        slots_kv[:, m:], slots_gate[:, m:] = kv[..., d:], gate[..., d:]
        slots_kv[1:, :m], slots_gate[1:, :m] = kv[:-1, :, :d], gate[:-1, :, :d]
        if window.overlap_kv is not None:
            slots_kv[0, :m], slots_gate[0, :m] = window.overlap_kv, window.overlap_gate
        after.overlap_kv, after.overlap_gate = kv[-1, :, :d].copy(), gate[-1, :, :d].copy()
        kv, gate = slots_kv, slots_gate
    return pool_entries(kv, gate, w.norm, (np.arange(windows) + first_entry) * m, rope, eps), after


def pool_entries(slots_kv: np.ndarray, slots_gate: np.ndarray, norm: np.ndarray, positions: np.ndarray,
                 rope: InterleavedRope, eps: float) -> np.ndarray:
    """Entries from their slots ``[W, S, d]``: per-channel softmax over the S slots (−∞ gates
    are empty slots), weighted sum, RMSNorm, RoPE at each entry's position (kernel:
    ``dsv4_compress_entries``)."""
    pooled = np.sum(slots_kv * _softmax(slots_gate, axis=1), axis=1)
    return rope.apply(rms_norm(pooled, norm, eps), positions)


def _update_compressed(ops: Any, x: np.ndarray, w: CompressorWeights, cache: SequenceLayerCache, which: str,
                       rope: InterleavedRope, eps: float) -> np.ndarray:
    """Run a compressor over the new tokens, write what closes, return every entry so far."""
    first = cache.start // w.ratio
    new, after = compress(ops, x, w, cache.open_window(which, w.ratio, w.overlap), first, rope, eps)
    cache.store_open_window(which, after)
    cache.write_entries(which, first, new)
    return np.concatenate([cache.entries(which, first), new])


def index_select(ops: Any, x: np.ndarray, qr: np.ndarray, positions: np.ndarray, w: IndexerWeights,
                 cache: SequenceLayerCache, rope: InterleavedRope, eps: float) -> np.ndarray:
    """The indexer's pick: bool ``[n, entries]``, True where entry s is in query t's top-k
    among the causally visible entries (s < (t+1)//m)."""
    keys = _update_compressed(ops, x, w.compressor, cache, INDEXER, rope, eps)
    n, num_entries = x.shape[0], keys.shape[0]
    visible = np.arange(num_entries)[None, :] < ((positions + 1) // w.compressor.ratio)[:, None]
    k = min(w.topk, num_entries)
    if k >= num_entries:
        return visible
    q = rope.apply(ops.linear(qr, w.wq_b).reshape(n, w.num_heads, w.head_dim), positions)
    head_weights = ops.linear(x, w.weights_proj) * np.float32(w.num_heads**-0.5 * w.head_dim**-0.5)
    return top_k_visible(index_scores(q, keys, head_weights), visible, k)


def index_scores(q: np.ndarray, keys: np.ndarray, head_weights: np.ndarray) -> np.ndarray:
    """``score[t, s] = Σ_h w[t, h]·relu(q[t, h]·k[s])`` (the scales folded into ``w``)
    (kernel: ``dsv4_indexer_scores``)."""
    return np.einsum("ths,th->ts", np.maximum(np.einsum("thd,sd->ths", q, keys), 0.0), head_weights)


def top_k_visible(scores: np.ndarray, visible: np.ndarray, k: int) -> np.ndarray:
    """Bool ``[n, entries]``: each row's k best visible entries (all of them when fewer)
    (kernel: ``dsv4_topk``)."""
    total = np.where(visible, scores, -np.inf)
    top = np.argpartition(-total, k - 1, axis=-1)[:, :k]
    chosen = np.zeros_like(visible)
    np.put_along_axis(chosen, top, True, axis=-1)
    return chosen & visible


def attend(q: np.ndarray, keys: np.ndarray, mask: np.ndarray, sink: np.ndarray, positions: np.ndarray,
           rope: InterleavedRope, head_dim: int) -> np.ndarray:
    """``[n, H, D]``: softmax over the allowed keys (``mask [n, K]``) and the per-head sink, values
    = keys, then RoPE⁻¹ at the query positions (kernel: ``dsv4_sparse_attention``)."""
    logits = np.einsum("thd,kd->htk", q, keys) * np.float32(head_dim**-0.5)
    logits = np.where(mask[None], logits, -np.inf)
    sink = sink[:, None, None]
    peak = np.maximum(logits.max(axis=-1, keepdims=True), sink)
    probs = np.exp(logits - peak)
    denominator = probs.sum(axis=-1, keepdims=True) + np.exp(sink - peak)
    out = np.einsum("htk,kd->thd", probs / denominator, keys)
    return rope.apply(out, positions, inverse=True)


def attention(ops: Any, x: np.ndarray, positions: np.ndarray, w: AttentionWeights, cache: SequenceLayerCache,
              rope: InterleavedRope, *, num_heads: int, head_dim: int, window: int, eps: float) -> np.ndarray:
    """One layer's attention for one sequence's new tokens; updates its caches. Returns [n, hidden]."""
    n = x.shape[0]
    qr = ops.rms_norm(ops.linear(x, w.wq_a), w.q_norm, eps)
    q = rms_norm(ops.linear(qr, w.wq_b).reshape(n, num_heads, head_dim), None, eps)
    q = rope.apply(q, positions)
    kv = rope.apply(ops.rms_norm(ops.linear(x, w.wkv), w.kv_norm, eps), positions)

    past = cache.past_keys(window)
    cache.write_keys(kv)
    keys = np.concatenate([past, kv])  # positions start - len(past) … start + n - 1
    key_positions = np.arange(positions[0] - past.shape[0], positions[-1] + 1)
    offsets = positions[:, None] - key_positions[None, :]
    masks = [(offsets >= 0) & (offsets < window)]
    if w.compressor is not None:
        entries = _update_compressed(ops, x, w.compressor, cache, COMPRESSOR, rope, eps)
        if w.indexer is not None:
            visible = index_select(ops, x, qr, positions, w.indexer, cache, rope, eps)
        else:
            visible = np.arange(entries.shape[0])[None, :] < ((positions + 1) // w.compressor.ratio)[:, None]
        keys = np.concatenate([keys, entries])
        masks.append(visible)
    out = attend(q, keys, np.concatenate(masks, axis=1), w.sink, positions, rope, head_dim)
    groups = w.wo_a.shape[0]
    grouped = out.reshape(n, groups, -1)
    low_rank = np.einsum("tgi,goi->tgo", grouped, w.wo_a).reshape(n, -1)
    return ops.linear(np.ascontiguousarray(low_rank, np.float32), w.wo_b)
