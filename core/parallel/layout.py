"""How a model is split over ranks, checked before anything loads.

``ParallelLayout`` is what the flags ask for (``--tensor-parallel-size``,
``--expert-parallel-size``); ``TensorShard`` / ``ExpertShard`` are one rank's part of it::

    world = max(tp, ep)   (when both exceed 1 they must be equal: the same ranks split
                           attention by heads and the MoE by experts)

    tensor parallel, rank r of tp           expert parallel, rank r of ep
      heads      r*H/tp .. (r+1)*H/tp          experts  r*E/ep .. (r+1)*E/ep
      kv heads   split like heads, or each     tokens   dispatched to the rank holding
                 replicated tp/KV times when            their expert, combined back
                 tp > KV (rank r holds r*KV/tp)
      vocab      ceil(V/tp) rows each, the last rank's padded with zeros
"""

from __future__ import annotations

from dataclasses import dataclass

from openinfer.errors import ParallelConfigError


@dataclass(frozen=True)
class ParallelLayout:
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    # under expert parallel: each rank runs attention for its own sequences and caches only
    # their KV (``openinfer.parallel.data``) instead of every rank repeating it for all
    attention_data_parallel: bool = False

    def __post_init__(self) -> None:
        tp, ep = self.tensor_parallel_size, self.expert_parallel_size
        if self.attention_data_parallel and (ep < 2 or tp > 1):
            raise ParallelConfigError(
                f"data-parallel attention splits the sequences over the expert-parallel ranks: it needs "
                f"--expert-parallel-size of at least 2 (got {ep}) and --tensor-parallel-size 1 (got {tp})")
        if tp < 1 or ep < 1:
            raise ParallelConfigError(
                f"--tensor-parallel-size ({tp}) and --expert-parallel-size ({ep}) must be at least 1")
        if tp > 1 and ep > 1 and tp != ep:
            raise ParallelConfigError(
                f"--tensor-parallel-size {tp} with --expert-parallel-size {ep}: when both exceed 1 they must be "
                "equal (the same ranks split attention by heads and the experts); set one of them to 1")

    @property
    def world_size(self) -> int:
        return max(self.tensor_parallel_size, self.expert_parallel_size)

    def tensor_shard(self, rank: int) -> TensorShard:
        return TensorShard(rank, self.tensor_parallel_size) if self.tensor_parallel_size > 1 else TensorShard()

    def expert_shard(self, rank: int) -> ExpertShard:
        return ExpertShard(rank, self.expert_parallel_size) if self.expert_parallel_size > 1 else ExpertShard()


def check_devices(layout: ParallelLayout, num_gpus: int) -> None:
    """More ranks than GPUs is refused: each rank is one process owning one GPU."""
    if layout.world_size > num_gpus:
        flag = ("--tensor-parallel-size" if layout.tensor_parallel_size >= layout.expert_parallel_size
                else "--expert-parallel-size")
        raise ParallelConfigError(
            f"{flag} {layout.world_size} needs {layout.world_size} GPUs (one rank per GPU) but this machine has "
            f"{num_gpus}; lower {flag} to at most {num_gpus}")


@dataclass(frozen=True)
class TensorShard:
    """One rank's part of a tensor-parallel layer (``size == 1``: the whole layer)."""

    rank: int = 0
    size: int = 1

    def split(self, total: int, what: str) -> slice:
        """This rank's equal part of ``total`` (heads, intermediate rows, ...)."""
        if total % self.size:
            raise ParallelConfigError(
                f"{what} = {total} does not divide by --tensor-parallel-size {self.size}; "
                f"choose a tensor-parallel size that divides {total}")
        part = total // self.size
        return slice(self.rank * part, (self.rank + 1) * part)

    def kv_heads(self, num_kv_heads: int) -> slice:
        """KV heads: split when ``size <= num_kv_heads``, else each replicated on
        ``size / num_kv_heads`` ranks (rank r holds head ``r * num_kv_heads // size``)."""
        if self.size <= num_kv_heads:
            return self.split(num_kv_heads, "num_key_value_heads")
        if self.size % num_kv_heads:
            raise ParallelConfigError(
                f"--tensor-parallel-size {self.size} exceeds num_key_value_heads = {num_kv_heads} and is not a "
                f"multiple of it, so KV heads cannot be replicated evenly; use a size dividing {num_kv_heads} "
                f"or a multiple of it")
        head = self.rank * num_kv_heads // self.size
        return slice(head, head + 1)

    def vocab(self, vocab_size: int) -> VocabShard:
        per_rank = -(-vocab_size // self.size)
        start = min(vocab_size, self.rank * per_rank)
        return VocabShard(start=start, end=min(vocab_size, start + per_rank), padded_size=per_rank)


@dataclass(frozen=True)
class VocabShard:
    """Rows ``start..end`` of the embedding / LM head, zero-padded to ``padded_size`` rows so
    every rank's part has the same shape (the all-gather needs equal parts)."""

    start: int
    end: int
    padded_size: int

    @property
    def num_rows(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ExpertShard:
    """One rank's experts: ``start .. start + num_local`` of ``num_experts``."""

    rank: int = 0
    size: int = 1

    def experts(self, num_experts: int) -> slice:
        if self.size > num_experts:
            raise ParallelConfigError(
                f"--expert-parallel-size {self.size} exceeds the model's {num_experts} routed experts; "
                f"use at most {num_experts}")
        if num_experts % self.size:
            raise ParallelConfigError(
                f"the model's {num_experts} routed experts do not divide by --expert-parallel-size {self.size}; "
                f"choose a size dividing {num_experts}")
        part = num_experts // self.size
        return slice(self.rank * part, (self.rank + 1) * part)


def check_attention_heads(shard: TensorShard, num_heads: int, num_kv_heads: int) -> None:
    """Heads must split evenly and KV heads split or replicate evenly (raises before loading)."""
    shard.split(num_heads, "num_attention_heads")
    shard.kv_heads(num_kv_heads)
