"""What each rank will hold on its GPU — weights, KV cache, CUDA graphs — computed from
config.json alone, before anything loads, and refused with the flag to change when it does
not fit.

A model family describes itself as a ``ModelMemory``: every tensor with its shape, bytes per
element (packed quantized formats are fractional: FP4 = 0.5 plus scales) and how it splits::

    replicated   every rank holds it whole (norms, routers, small vectors)
    tensor       split over the tensor-parallel ranks (q/o/gate/up/down, GDN projections)
    kv_heads     split over tensor-parallel ranks by KV head, replicated once tp > heads
    vocab        ceil(vocab / tp) rows per rank (embedding, LM head)
    experts      split over the expert-parallel ranks (routed experts)

and its KV bytes per token (all layers, at the serving dtype), split by KV head under tensor
parallel (``kv_split="heads"``) or held whole by every rank (``"replicated"``: MLA's latent
cache under tensor-parallel attention; with data-parallel attention each rank caches only its
own requests, ``"data"``, as it does for any model when the layout asks for data-parallel
attention: the group then caches about the sum of the ranks' tokens over the headroom).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from openinfer.errors import ParallelConfigError
from openinfer.parallel.data import engine_blocks
from openinfer.parallel.layout import ParallelLayout

GIB = 2**30
GRAPH_AND_ACTIVATION_RESERVE = 2 * GIB  # as the cuda backend reserves: a 2048-token step + graph pools
SPLITS = ("replicated", "tensor", "kv_heads", "vocab", "experts")


class MemoryPlanError(ParallelConfigError):
    """The model does not fit the GPUs with the flags given."""


@dataclass(frozen=True)
class TensorPlacement:
    shape: tuple[int, ...]
    bytes_per_element: float
    split: str  # one of SPLITS

    @property
    def num_bytes(self) -> float:
        return math.prod(self.shape) * self.bytes_per_element


@dataclass(frozen=True)
class ModelMemory:
    tensors: Mapping[str, TensorPlacement]
    kv_bytes_per_token: int  # whole model: every layer, every KV head
    num_kv_heads: int = 1
    kv_split: str = "heads"  # "heads" | "replicated" | "data"
    description: str = ""


@dataclass(frozen=True)
class RankMemory:
    rank: int
    weight_bytes: float
    kv_bytes_per_token: float
    reserve_bytes: int
    gpu_bytes: int
    gpu_memory_utilization: float
    by_split: dict[str, float] = field(default_factory=dict)

    @property
    def kv_budget_bytes(self) -> float:
        return self.gpu_memory_utilization * self.gpu_bytes - self.weight_bytes - self.reserve_bytes

    @property
    def kv_tokens(self) -> int:
        return max(0, int(self.kv_budget_bytes // max(1.0, self.kv_bytes_per_token)))


@dataclass(frozen=True)
class MemoryPlan:
    layout: ParallelLayout
    ranks: list[RankMemory]
    max_model_len: int
    max_num_seqs: int
    description: str = ""

    def check(self) -> None:
        """Raise ``MemoryPlanError`` naming the flag to change when a rank cannot hold its part."""
        worst = max(self.ranks, key=lambda r: r.weight_bytes)
        usable = worst.gpu_memory_utilization * worst.gpu_bytes
        if worst.weight_bytes + worst.reserve_bytes > usable:
            flag = ("--expert-parallel-size" if self.layout.expert_parallel_size > 1
                    or any(k == "experts" and v > 0 for k, v in worst.by_split.items()) else "--tensor-parallel-size")
            raise MemoryPlanError(
                f"rank {worst.rank} would hold {worst.weight_bytes / GIB:.1f} GiB of weights + "
                f"{worst.reserve_bytes / GIB:.1f} GiB for activations and CUDA graphs, more than the "
                f"{usable / GIB:.1f} GiB usable on its GPU ({worst.gpu_memory_utilization:.2f} of "
                f"{worst.gpu_bytes / GIB:.1f} GiB); raise {flag} (more GPUs) or --gpu-memory-utilization")
        one_sequence = self.max_model_len * worst.kv_bytes_per_token
        if worst.kv_budget_bytes < one_sequence:
            raise MemoryPlanError(
                f"rank {worst.rank} has {max(0.0, worst.kv_budget_bytes) / GIB:.2f} GiB left for the KV cache, less "
                f"than one {self.max_model_len}-token sequence needs ({one_sequence / GIB:.2f} GiB); lower "
                f"--max-model-len, or raise --tensor-parallel-size / --gpu-memory-utilization")

    def render(self) -> str:
        """The plan as a table, one row per rank."""
        lines = [f"memory plan: {self.description or 'model'} on {self.layout.world_size} rank(s) "
                 f"(tp={self.layout.tensor_parallel_size}, ep={self.layout.expert_parallel_size})",
                 f"{'rank':>4}  {'weights GiB':>11}  {'graphs+act GiB':>14}  {'KV GiB':>8}  {'KV tokens':>10}  "
                 f"{'seqs @ ' + str(self.max_model_len):>12}  {'GPU GiB':>8}"]
        for r in self.ranks:
            kv = max(0.0, r.kv_budget_bytes)
            seqs = r.kv_tokens // max(1, self.max_model_len)
            lines.append(f"{r.rank:>4}  {r.weight_bytes / GIB:>11.2f}  {r.reserve_bytes / GIB:>14.2f}  "
                         f"{kv / GIB:>8.2f}  {r.kv_tokens:>10}  {seqs:>12}  {r.gpu_bytes / GIB:>8.1f}")
        first = self.ranks[0]
        parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in sorted(first.by_split.items()) if v)
        lines.append(f"rank 0 weights by split (GiB): {parts}; KV {first.kv_bytes_per_token / 1024:.1f} KiB/token")
        lines.append(f"the group caches {self.system_kv_tokens} tokens"
                     + (" (data-parallel attention: each rank its own sequences)"
                        if self.layout.attention_data_parallel else " (every rank holds its part of each token)"))
        return "\n".join(lines)

    @property
    def system_kv_tokens(self) -> int:
        """Tokens the engine's pool holds: what the fullest rank holds (every rank holds a part,
        or a copy, of every token), or under data-parallel attention, where each rank caches its
        own sequences, the ranks' sum less the headroom each keeps for uneven sequences (the
        pool the engine sizes, ``openinfer.parallel.data.engine_blocks``)."""
        fullest = min(r.kv_tokens for r in self.ranks)
        if self.layout.attention_data_parallel and fullest > 0:
            return engine_blocks(fullest, len(self.ranks))
        return fullest

    def as_dict(self) -> dict:
        return {"tensor_parallel_size": self.layout.tensor_parallel_size,
                "expert_parallel_size": self.layout.expert_parallel_size,
                "max_model_len": self.max_model_len,
                "attention_data_parallel": self.layout.attention_data_parallel,
                "system_kv_tokens": self.system_kv_tokens,
                "ranks": [{"rank": r.rank, "weight_gib": r.weight_bytes / GIB, "reserve_gib": r.reserve_bytes / GIB,
                           "kv_gib": max(0.0, r.kv_budget_bytes) / GIB, "kv_tokens": r.kv_tokens,
                           "kv_bytes_per_token": r.kv_bytes_per_token, "gpu_gib": r.gpu_bytes / GIB,
                           "weights_by_split_gib": {k: v / GIB for k, v in r.by_split.items()}}
                          for r in self.ranks]}


def _rank_share(placement: TensorPlacement, layout: ParallelLayout, num_kv_heads: int) -> float:
    tp, ep = layout.tensor_parallel_size, layout.expert_parallel_size
    total = placement.num_bytes
    if placement.split == "tensor":
        return total / tp
    if placement.split == "kv_heads":
        return total / min(tp, num_kv_heads)
    if placement.split == "vocab":
        rows = placement.shape[0]
        return total / rows * math.ceil(rows / tp)
    if placement.split == "experts":
        return total / ep
    if placement.split == "replicated":
        return total
    raise ValueError(f"unknown split {placement.split!r}; one of {SPLITS}")


def plan_memory(model: ModelMemory, layout: ParallelLayout, *, gpu_bytes: int, gpu_memory_utilization: float = 0.9,
                max_model_len: int = 4096, max_num_seqs: int = 256,
                reserve_bytes: int = GRAPH_AND_ACTIVATION_RESERVE) -> MemoryPlan:
    """Every rank's share (ranks hold equal shares: splits are even by construction)."""
    by_split: dict[str, float] = {}
    for placement in model.tensors.values():
        by_split[placement.split] = by_split.get(placement.split, 0.0) + _rank_share(placement, layout,
                                                                                      model.num_kv_heads)
    tp = layout.tensor_parallel_size
    if model.kv_split == "heads":
        kv_per_token = model.kv_bytes_per_token / min(tp, model.num_kv_heads)
    else:  # replicated on every rank, or data-parallel: each rank caches its own requests in full
        kv_per_token = float(model.kv_bytes_per_token)
    weights = sum(by_split.values())
    ranks = [RankMemory(rank, weights, kv_per_token, reserve_bytes, gpu_bytes, gpu_memory_utilization, dict(by_split))
             for rank in range(layout.world_size)]
    return MemoryPlan(layout, ranks, max_model_len, max_num_seqs, model.description)


def classify_dense_tensor(name: str) -> str:
    """The split of a dense decoder's tensor, from its checkpoint name."""
    if name.endswith("embed_tokens.weight") or name.startswith("lm_head."):
        return "vocab"
    if "norm" in name or name.endswith(("A_log", "dt_bias")) or name.endswith("o_proj.bias") \
            or name.endswith("down_proj.bias"):
        return "replicated"
    if any(part in name for part in ("k_proj.", "v_proj.")):
        return "kv_heads"
    return "tensor"


def dense_model_memory(shapes: Mapping[str, tuple[int, ...]], *, num_kv_heads: int, kv_bytes_per_token: int,
                       bytes_per_element: float = 2.0, description: str = "") -> ModelMemory:
    """A ``ModelMemory`` for a dense decoder stored at ``bytes_per_element`` (bf16: 2)."""
    return ModelMemory({name: TensorPlacement(tuple(shape), bytes_per_element, classify_dense_tensor(name))
                        for name, shape in shapes.items()}, kv_bytes_per_token=kv_bytes_per_token,
                       num_kv_heads=num_kv_heads, description=description)
