"""Manifold-constrained hyper-connections (mHC): the residual is ``hc`` streams, not one.

Hidden state ``H`` is ``[T, hc, D]`` (the embedding repeated ``hc`` times at the start). Around
each sub-layer (attention, then MoE), from ``flat = rms(H.reshape(T, hc·D))`` (no weight)::

    m    = flat @ fnᵀ                                  [T, 2·hc + hc²]
    pre  = σ(m[:hc]·s0 + b[:hc]) + ε                   collapse weights
    post = 2σ(m[hc:2hc]·s1 + b[hc:2hc])                expand weights
    C    = Sinkhorn(softmax_rows(m[2hc:]·s2 + b[2hc:]) + ε)   doubly stochastic [hc, hc]
    x    = Σ_j pre_j H_j  →  y = sublayer(RMSNorm(x))
    H'_k = post_k · y + Σ_j C[j, k] · H_j             (C applied transposed)

Sinkhorn: normalise columns once, then ``iters − 1`` rounds of rows then columns (each sum + ε).
The head collapses the streams once more: ``pre = σ(m·s + b) + ε``, ``h = Σ pre_j H_j``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from openinfer_deepseek_v4.weights import HyperConnectionWeights


@dataclass
class Mixing:
    post: np.ndarray  # [T, hc]
    comb: np.ndarray  # [T, hc, hc]


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _stream_logits(streams: np.ndarray, fn: np.ndarray, norm_eps: float) -> np.ndarray:
    flat = streams.reshape(streams.shape[0], -1)
    flat = flat / np.sqrt(np.mean(flat * flat, axis=-1, keepdims=True) + np.float32(norm_eps))
    return flat @ fn.T


def collapse(streams: np.ndarray, w: HyperConnectionWeights, *, hc_eps: float, sinkhorn_iters: int,
             norm_eps: float) -> tuple[np.ndarray, Mixing]:
    """``(x [T, D], mixing)``: the sub-layer input and the weights ``expand`` needs after it."""
    hc = streams.shape[1]
    m = _stream_logits(streams, w.fn, norm_eps)
    scale_pre, scale_post, scale_comb = (np.float32(s) for s in w.scale)
    pre = _sigmoid(m[:, :hc] * scale_pre + w.base[:hc]) + np.float32(hc_eps)
    post = 2.0 * _sigmoid(m[:, hc:2 * hc] * scale_post + w.base[hc:2 * hc])
    logits = m[:, 2 * hc:].reshape(-1, hc, hc) * scale_comb + w.base[2 * hc:].reshape(hc, hc)
    comb = np.exp(logits - logits.max(axis=-1, keepdims=True))
    comb = comb / comb.sum(axis=-1, keepdims=True) + np.float32(hc_eps)
    comb = comb / (comb.sum(axis=-2, keepdims=True) + np.float32(hc_eps))
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + np.float32(hc_eps))
        comb = comb / (comb.sum(axis=-2, keepdims=True) + np.float32(hc_eps))
    x = np.einsum("th,thd->td", pre, streams)
    return x.astype(np.float32), Mixing(post.astype(np.float32), comb.astype(np.float32))


def expand(streams: np.ndarray, y: np.ndarray, mixing: Mixing) -> np.ndarray:
    """``H'_k = post_k · y + Σ_j C[j, k] · H_j``."""
    mixed = np.einsum("tjk,tjd->tkd", mixing.comb, streams)
    return (mixing.post[:, :, None] * y[:, None, :] + mixed).astype(np.float32)


def collapse_head(streams: np.ndarray, w: HyperConnectionWeights, *, hc_eps: float, norm_eps: float) -> np.ndarray:
    m = _stream_logits(streams, w.fn, norm_eps)
    pre = _sigmoid(m * np.float32(w.scale[0]) + w.base) + np.float32(hc_eps)
    return np.einsum("th,thd->td", pre, streams).astype(np.float32)
