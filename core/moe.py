"""Mixture-of-experts: routing, token→expert grouping, expert GEMMs, weighted combine, shared experts.

One layer's flow (T tokens, E routed experts, top-k per token)::

    x [T, H] ──► router logits [T, E] (fp32) ──► route() ──► ids [T, k], weights [T, k]
       │                                                          │
       │                          group_by_expert(ids) ◄──────────┘
       │                          order [T·k] (slots sorted by expert), offsets [E+1]
       ▼
    rows x[order // k] of expert e = order[offsets[e]:offsets[e+1]]
       ──► down_e(silu(gate_e(x)) · up_e(x)) · weight ──► scatter-add into out [T, H]
    out += shared_experts(x)                   (a dense SwiGLU MLP, when the model has one)

Routers covered by ``RouterSpec`` (every DeepSeek-family and Mixtral/Qwen-MoE style):

* ``scoring``: ``softmax`` (over all experts), ``sigmoid``, ``sqrtsoftplus`` (sqrt(softplus(l)),
  DeepSeek-V4) — scores always in fp32;
* an optional per-expert ``correction_bias`` added for the *choice* only (``noaux_tc``), the
  combine weights stay the unbiased scores;
* group-limited top-k: experts split into ``num_groups`` equal groups, each group scored by the
  sum of its best two choice scores (``group_score="top2_sum"``, DeepSeek-V3) or its best one
  (``"max"``, DeepSeek-V2), keep the best ``topk_groups`` groups, pick top-k among them;
* hash routing: ``tid2eid [vocab, k]`` fixes the experts per token id (DeepSeek-V4 hash layers);
* ``norm_topk_prob`` renormalises the k weights to sum 1 (``+1e-20``), then
  ``routed_scaling_factor`` multiplies them.

Expert weights stay a per-expert list (``MoEWeights.experts[e]``) so expert parallelism can hand
each rank a slice of experts; a backend may keep its own stacked copy next to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from openinfer.errors import WeightLoadError

SCORING_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
GROUP_SCORES = ("top2_sum", "max")


@dataclass(frozen=True)
class RouterSpec:
    """How one MoE layer picks its experts (static, from config.json)."""

    num_experts: int
    top_k: int
    scoring: str = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    group_score: str = "top2_sum"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in SCORING_FUNCTIONS:
            raise WeightLoadError(f"scoring_func {self.scoring!r} is not supported "
                                  f"(supported: {', '.join(SCORING_FUNCTIONS)})")
        if self.group_score not in GROUP_SCORES:
            raise WeightLoadError(f"group score {self.group_score!r} is not one of {GROUP_SCORES}")
        if not 1 <= self.top_k <= self.num_experts:
            raise WeightLoadError(f"num_experts_per_tok={self.top_k} must be in 1..n_routed_experts "
                                  f"({self.num_experts})")
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise WeightLoadError(f"n_group={self.num_groups} must divide n_routed_experts={self.num_experts}")
        if not 1 <= self.topk_groups <= self.num_groups:
            raise WeightLoadError(f"topk_group={self.topk_groups} must be in 1..n_group ({self.num_groups})")
        per_group = self.num_experts // self.num_groups
        if self.num_groups > 1 and self.topk_groups * per_group < self.top_k:
            raise WeightLoadError(f"topk_group={self.topk_groups} groups of {per_group} experts cannot hold "
                                  f"num_experts_per_tok={self.top_k} experts")


def expert_scores(logits: np.ndarray, scoring: str) -> np.ndarray:
    """Per-expert scores from router logits ``[T, E]`` (fp32)."""
    logits = np.asarray(logits, dtype=np.float32)
    if scoring == "softmax":
        shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
        return shifted / shifted.sum(axis=-1, keepdims=True)
    if scoring == "sigmoid":
        return 1.0 / (1.0 + np.exp(-logits))
    if scoring == "sqrtsoftplus":
        # softplus(l) = log(1 + e^l), computed without overflow for large l
        return np.sqrt(np.logaddexp(np.float32(0.0), logits)).astype(np.float32)
    raise WeightLoadError(f"scoring_func {scoring!r} is not supported")


def _top_indices(values: np.ndarray, k: int) -> np.ndarray:
    """Column indices of the k largest values per row (order within the k unspecified)."""
    if k == values.shape[-1]:
        return np.broadcast_to(np.arange(k), values.shape).copy()
    return np.argpartition(-values, k - 1, axis=-1)[..., :k]


def route(logits: np.ndarray, spec: RouterSpec, correction_bias: np.ndarray | None = None,
          token_ids: np.ndarray | None = None, tid2eid: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Choose experts: ``(weights [T, k] float32, expert ids [T, k] int32)``.

    ``tid2eid`` (hash routing) needs ``token_ids``; it replaces the top-k choice, the weights
    are still the scores of the chosen experts.
    """
    scores = expert_scores(logits, spec.scoring)
    num_tokens = scores.shape[0]
    if tid2eid is not None:
        if token_ids is None:
            raise ValueError("hash routing (tid2eid) needs the token ids")
        ids = np.asarray(tid2eid)[np.asarray(token_ids)].astype(np.int32)
    else:
        choice = scores if correction_bias is None else scores + np.asarray(correction_bias, np.float32)
        if spec.num_groups > 1:
            per_group = spec.num_experts // spec.num_groups
            grouped = choice.reshape(num_tokens, spec.num_groups, per_group)
            if spec.group_score == "top2_sum":
                best_two = -np.partition(-grouped, 1, axis=-1)[..., :2]
                group_scores = best_two.sum(axis=-1)
            else:
                group_scores = grouped.max(axis=-1)
            kept = _top_indices(group_scores, spec.topk_groups)
            mask = np.zeros((num_tokens, spec.num_groups), dtype=bool)
            np.put_along_axis(mask, kept, True, axis=-1)
            choice = np.where(np.repeat(mask, per_group, axis=-1), choice, -np.inf)
        ids = _top_indices(choice, spec.top_k).astype(np.int32)
    weights = np.take_along_axis(scores, ids, axis=-1)
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return (weights * np.float32(spec.routed_scaling_factor)).astype(np.float32), ids


@dataclass(frozen=True)
class ExpertGrouping:
    """The step's (token, slot) pairs sorted by expert, so each expert runs one GEMM on its rows::

        ids      [[3, 0], [0, 2]]          T=2 tokens, k=2
        order    [1, 2, 3, 0]              flat slots t·k+j sorted by expert (stable)
        offsets  [0, 2, 2, 3, 4]           expert e owns order[offsets[e]:offsets[e+1]]
        tokens   order // k = [0, 1, 1, 0]
    """

    order: np.ndarray  # [T·k] int64
    offsets: np.ndarray  # [E+1] int64
    top_k: int

    @property
    def token_rows(self) -> np.ndarray:
        return self.order // self.top_k

    def rows_of(self, expert: int) -> np.ndarray:
        return self.order[self.offsets[expert]:self.offsets[expert + 1]]

    def active_experts(self) -> np.ndarray:
        return np.flatnonzero(np.diff(self.offsets))


def group_by_expert(ids: np.ndarray, num_experts: int) -> ExpertGrouping:
    flat = np.asarray(ids).reshape(-1)
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=num_experts)
    offsets = np.zeros(num_experts + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return ExpertGrouping(order, offsets, int(np.asarray(ids).shape[-1]))


@dataclass
class ExpertWeights:
    """One SwiGLU expert: fused ``gate_up [2I, H]`` and ``down [H, I]`` as backend linear weights."""

    gate_up: Any
    down: Any


@dataclass
class MoEWeights:
    """One MoE layer. ``experts`` is indexable by expert id (a rank holding a slice of experts
    keeps ``None`` for the others); ``stacked`` is a backend's private fused copy, if any."""

    router: RouterSpec
    gate: np.ndarray  # [E, H] router weight, fp32 on the host (routing runs in fp32)
    experts: Sequence[ExpertWeights | None]
    correction_bias: np.ndarray | None = None  # [E]
    tid2eid: np.ndarray | None = None  # [vocab, k] for hash-routed layers
    shared: ExpertWeights | None = None
    swiglu_limit: float | None = None  # DeepSeek-V4 clamps gate (max) and up (±limit)
    stacked: Any = field(default=None, repr=False)


def swiglu(gate_up: np.ndarray, limit: float | None = None) -> np.ndarray:
    """``silu(gate) · up`` of a fused ``[N, 2I]`` row block; with ``limit``: gate ≤ limit,
    up ∈ [−limit, limit] first."""
    half = gate_up.shape[-1] // 2
    gate, up = gate_up[:, :half], gate_up[:, half:]
    if limit is not None:
        gate = np.minimum(gate, limit)
        up = np.clip(up, -limit, limit)
    return gate / (1.0 + np.exp(-gate)) * up


def run_experts(ops: Any, x: np.ndarray, weights: np.ndarray, grouping: ExpertGrouping,
                experts: Sequence[ExpertWeights | None], swiglu_limit: float | None = None) -> np.ndarray:
    """Reference expert compute on the NumPy backend: per active expert one gate_up GEMM, SwiGLU,
    one down GEMM over its sorted rows, scaled by the routing weight, scatter-added per token."""
    out = np.zeros_like(x)
    flat_weights = weights.reshape(-1)
    token_rows = grouping.token_rows
    for expert in grouping.active_experts():
        weights_e = experts[expert]
        if weights_e is None:
            raise ValueError(f"expert {expert} is not held by this rank")
        slots = grouping.rows_of(int(expert))
        rows = token_rows[grouping.offsets[expert]:grouping.offsets[expert + 1]]
        hidden = swiglu(ops.linear(x[rows], weights_e.gate_up), swiglu_limit)
        y = ops.linear(hidden, weights_e.down)
        y *= flat_weights[slots][:, None]
        np.add.at(out, rows, y)
    return out


def router_logits(x: Any, gate: np.ndarray, ops: Any) -> np.ndarray:
    """fp32 router logits ``[T, E]`` on the host (``x`` may live on a device)."""
    return ops.to_host(x).astype(np.float32) @ np.asarray(gate, np.float32).T


def moe_forward(ops: Any, x: Any, layer: MoEWeights, token_ids: np.ndarray | None = None) -> Any:
    """One MoE block: routed experts + shared experts. A backend with its own ``moe`` op (fused,
    grouped GEMM) gets the routing decision and does the rest; otherwise the NumPy reference."""
    weights, ids = route(router_logits(x, layer.gate, ops), layer.router, layer.correction_bias,
                         token_ids if layer.tid2eid is not None else None, layer.tid2eid)
    fused = getattr(ops, "moe_experts", None)
    if fused is not None:
        out = fused(x, weights, ids, layer)
    else:
        out = run_experts(ops, x, weights, group_by_expert(ids, layer.router.num_experts), layer.experts,
                          layer.swiglu_limit)
    if layer.shared is not None:
        shared = ops.linear(ops.silu_mul(ops.linear(x, layer.shared.gate_up)), layer.shared.down) \
            if layer.swiglu_limit is None else \
            ops.linear(swiglu(ops.linear(x, layer.shared.gate_up), layer.swiglu_limit), layer.shared.down)
        out = ops.add(out, shared)
    return out
