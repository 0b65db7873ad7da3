"""DeepSeek-V4 MoE (NumPy reference): sqrt-softplus scores, hash or score top-k, clamped SwiGLU.

    s = sqrt(softplus(x @ Wgᵀ))                         fp32
    ids = tid2eid[token]            (hash layers)      ids = top-k(s + bias)   (other layers)
    w = s[ids] / (Σ s[ids] + 1e-20) · routed_scaling
    expert(x) = w2(silu(min(w1 x, L)) · clip(w3 x, −L, L))      L = swiglu_limit
    out = Σ_k w_k · expert_{ids_k}(x) + shared(x)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from openinfer_deepseek_v4.weights import ExpertWeights, MoEWeights


def _scores(logits: np.ndarray, scoring: str) -> np.ndarray:
    if scoring == "sqrtsoftplus":
        return np.sqrt(np.logaddexp(np.float32(0.0), logits))
    if scoring == "sigmoid":
        return 1.0 / (1.0 + np.exp(-logits))
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def route(x: np.ndarray, token_ids: np.ndarray, w: MoEWeights, *, top_k: int, scoring: str,
          routed_scaling: float) -> tuple[np.ndarray, np.ndarray]:
    """``(weights [T, k], expert ids [T, k])``."""
    scores = _scores(np.asarray(x, np.float32) @ w.gate.T, scoring)
    if w.tid2eid is not None:
        ids = w.tid2eid[np.asarray(token_ids)]
    else:
        ids = np.argpartition(-(scores + w.bias), top_k - 1, axis=-1)[:, :top_k]
    chosen = np.take_along_axis(scores, ids, axis=-1)
    weights = chosen / (chosen.sum(axis=-1, keepdims=True) + np.float32(1e-20)) * np.float32(routed_scaling)
    return weights.astype(np.float32), ids


def expert_forward(ops: Any, x: np.ndarray, w: ExpertWeights, limit: float) -> np.ndarray:
    gate, up = ops.linear(x, w.w1), ops.linear(x, w.w3)
    if limit > 0:
        gate = np.minimum(gate, np.float32(limit))
        up = np.clip(up, -np.float32(limit), np.float32(limit))
    return ops.linear((gate / (1.0 + np.exp(-gate)) * up).astype(np.float32), w.w2)


def moe(ops: Any, x: np.ndarray, token_ids: np.ndarray, w: MoEWeights, *, top_k: int, scoring: str,
        routed_scaling: float, swiglu_limit: float) -> np.ndarray:
    weights, ids = route(x, token_ids, w, top_k=top_k, scoring=scoring, routed_scaling=routed_scaling)
    out = np.zeros_like(x, dtype=np.float32)
    for expert in np.unique(ids):
        rows, slots = np.nonzero(ids == expert)
        y = expert_forward(ops, x[rows], w.experts[int(expert)], swiglu_limit)
        np.add.at(out, rows, y * weights[rows, slots][:, None])
    if w.shared is not None:
        out += expert_forward(ops, x, w.shared, swiglu_limit)
    return out
