"""Data-parallel attention under expert parallel: each rank runs attention (and the dense layers
around it) for its own sequences only and caches only their KV — MLA's latent cache is not
copied to every rank. The MoE layers still see every rank's tokens (all-gather + reduce-scatter,
``expert_parallel_moe_sharded``) and the logits of every sequence are all-gathered at the end::

    rank 0's scheduler ── the same ForwardBatch ──► every rank
    rank r:  split(batch) → its sequences, their block ids mapped into r's own smaller pool
             embed → [attention on own sequences → MoE over all ranks' tokens] × layers
             → logits of own rows → gather_logits → every sequence's logits, in batch order

Every rank sees the same batches in the same order, so each computes the same ownership with
no communication, from the engine's block tables alone (no request ids, no release calls):

- a sequence starting at position 0 goes to the rank owning the fewest blocks (ties: lowest);
- any other sequence (a decode step, the next chunk of a prompt, a prefix-cache hit) belongs
  to the rank owning its first block — where its earlier tokens' cache rows are;
- a block a sequence writes moves to that sequence's rank (the engine reused a freed block).

Each rank maps the engine's block ids it owns onto a local pool of
``min(N, ceil(headroom · N / ranks))`` blocks; a rank whose pool fills (sequences sharing one
prefix all land on the prefix's rank) raises ``OpenInferError`` naming the flags to change.
Sized from memory, the engine's pool is the inverse (``engine_blocks``): the largest N whose
local pools fit what one rank's KV budget holds, about ``ranks / headroom`` times it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from openinfer.backend.base import ForwardBatch
from openinfer.errors import OpenInferError
from openinfer.parallel.communicator import Communicator

DEFAULT_HEADROOM = 1.5  # a rank's pool over its even share: room for uneven sequence lengths


@dataclass(frozen=True)
class LocalStep:
    """One step split for this rank: ``batch`` is its sequences (local block ids, local rows);
    ``logits_owner[j]`` / ``logits_index[j]``: which rank computes global logits row j and at
    which of its local rows; ``logits_counts[r]``: how many rows rank r computes."""

    batch: ForwardBatch
    sequences: np.ndarray  # indices (into the global batch) of this rank's sequences
    logits_owner: np.ndarray
    logits_index: np.ndarray
    logits_counts: np.ndarray


def engine_blocks(rank_blocks: int, world_size: int, headroom: float = DEFAULT_HEADROOM) -> int:
    """The engine's pool for ranks that can each hold ``rank_blocks`` blocks: the most engine
    blocks N whose local pools ``min(N, ceil(headroom * N / world_size))`` fit in ``rank_blocks``."""
    if rank_blocks < 1 or world_size < 1 or headroom < 1.0:
        raise ValueError(f"need rank_blocks >= 1, world_size >= 1, headroom >= 1; got {rank_blocks}, "
                         f"{world_size}, {headroom}")
    blocks = max(rank_blocks, math.floor(rank_blocks * world_size / headroom))
    while blocks > rank_blocks and math.ceil(headroom * blocks / world_size) > rank_blocks:
        blocks -= 1  # the float product rounded up
    return blocks


class DataParallelAttention:
    """One rank's view of data-parallel attention: sequence ownership (identical on every rank),
    this rank's block translation, the split of each step and the gather of its logits."""

    def __init__(self, comm: Communicator, headroom: float = DEFAULT_HEADROOM):
        if headroom < 1.0:
            raise ValueError(f"headroom must be at least 1 (a rank's even share), got {headroom}")
        self.comm = comm
        self.rank = comm.rank
        self.world_size = comm.world_size
        self.headroom = headroom
        self.block_size = 0
        self.num_blocks = 0
        self.block_owner = np.zeros(0, np.int32)  # engine block id -> owning rank (-1: none yet)
        self.owned_blocks = np.zeros(self.world_size, np.int64)
        self.local_of = np.zeros(0, np.int32)  # engine block id -> this rank's block (-1: not here)
        self._free: list[int] = []

    def local_blocks(self, num_blocks: int, block_size: int) -> int:
        """Size this rank's pool for an engine pool of ``num_blocks``; returns how many blocks to
        allocate (call before allocating the KV cache). Resets the ownership: a new cache."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        local = min(num_blocks, math.ceil(self.headroom * num_blocks / self.world_size))
        self.block_size, self.num_blocks = block_size, num_blocks
        self.block_owner = np.full(num_blocks, -1, np.int32)
        self.owned_blocks = np.zeros(self.world_size, np.int64)
        self.local_of = np.full(num_blocks, -1, np.int32)
        self._free = list(range(local - 1, -1, -1))  # pop() hands out low ids first
        return local

    def engine_blocks(self, rank_blocks: int) -> int:
        """The engine's pool when each rank's memory holds ``rank_blocks`` (``local_blocks``'s inverse)."""
        return engine_blocks(rank_blocks, self.world_size, self.headroom)

    # --- ownership (the same on every rank) ---------------------------------------------------

    def _assign(self, batch: ForwardBatch) -> np.ndarray:
        """Each sequence's rank; moves the blocks it writes to that rank."""
        if not self.block_size:
            raise OpenInferError("data-parallel attention: local_blocks() was not called before the first step")
        tables = batch.group_block_tables(0)
        query_lens = np.diff(batch.query_start)
        owners = np.empty(batch.num_seqs, np.int32)
        for seq in range(batch.num_seqs):
            context = int(batch.context_lens[seq])
            start = context - int(query_lens[seq])
            first_written, last = start // self.block_size, (context - 1) // self.block_size
            if start == 0:
                owner = int(np.argmin(self.owned_blocks))
            else:
                owner = int(self.block_owner[tables[seq, 0]])
                held = self.block_owner[tables[seq, :first_written]]
                if owner < 0 or np.any(held != owner):
                    raise OpenInferError(
                        f"data-parallel attention: sequence {seq} continues at position {start} but its cached "
                        f"blocks {tables[seq, :first_written].tolist()} are held by ranks {held.tolist()}")
            owners[seq] = owner
            for block in tables[seq, first_written: last + 1].tolist():
                self._move(int(block), owner)
        return owners

    def _move(self, block: int, owner: int) -> None:
        previous = int(self.block_owner[block])
        if previous == owner:
            return
        if previous >= 0:
            self.owned_blocks[previous] -= 1
        self.owned_blocks[owner] += 1
        self.block_owner[block] = owner
        if previous == self.rank:  # the engine freed it and gave it to another rank's sequence
            self._free.append(int(self.local_of[block]))
            self.local_of[block] = -1
        elif owner == self.rank:
            if not self._free:
                raise OpenInferError(
                    f"data-parallel attention: rank {self.rank}'s KV pool ({self._capacity()} blocks) is full "
                    f"while it owns {int(self.owned_blocks[self.rank])} of the engine's {self.num_blocks}; its "
                    f"sequences share long cached prefixes or are much longer than the others'. Lower "
                    f"--num-kv-blocks / --max-num-seqs, or turn data-parallel attention off")
            self.local_of[block] = self._free.pop()

    def _capacity(self) -> int:
        return int(np.count_nonzero(self.local_of >= 0)) + len(self._free)

    # --- the step ---------------------------------------------------------------------------------

    def split(self, batch: ForwardBatch) -> LocalStep:
        """This rank's part of ``batch`` (a host batch; nothing of it is modified)."""
        if len(batch.kv_block_tables) > 1:
            raise OpenInferError("data-parallel attention handles models with one KV cache group")
        owners = self._assign(batch)
        mine = np.flatnonzero(owners == self.rank)
        starts, ends = batch.query_start[:-1], batch.query_start[1:]
        rows = (np.concatenate([np.arange(starts[s], ends[s]) for s in mine]) if mine.size
                else np.zeros(0, np.int64))
        local_query_start = np.concatenate([[0], np.cumsum(ends[mine] - starts[mine])]).astype(np.int32)

        # logits rows: the owner of each row's sequence and its index among that owner's rows
        row_owner = np.repeat(owners, ends - starts)
        logits_owner = row_owner[batch.logits_rows].astype(np.int32)
        logits_index = np.zeros_like(logits_owner)
        counts = np.zeros(self.world_size, np.int64)
        for j, owner in enumerate(logits_owner.tolist()):
            logits_index[j] = counts[owner]
            counts[owner] += 1
        local_row = np.full(batch.num_tokens, -1, np.int64)
        local_row[rows] = np.arange(rows.size)
        local_logits = local_row[batch.logits_rows[logits_owner == self.rank]].astype(np.int32)

        tables = batch.group_block_tables(0)[mine]
        used = -(-batch.context_lens[mine] // self.block_size)
        columns = np.arange(tables.shape[1])[None, :]
        in_range = np.clip(tables, 0, self.num_blocks - 1)  # columns past a sequence's blocks may be padding
        local_tables = np.where(columns < used[:, None], self.local_of[in_range], 0).astype(np.int32)
        slots = batch.group_slot_mapping(0)[rows].astype(np.int64)
        written = slots >= 0
        local_slots = np.full(rows.size, -1, np.int32)
        local_slots[written] = (self.local_of[slots[written] // self.block_size] * self.block_size
                                + slots[written] % self.block_size)
        lengths = batch.context_lens[mine]
        local = replace(
            batch, token_ids=batch.token_ids[rows].astype(np.int32), positions=batch.positions[rows].astype(np.int32),
            query_start=local_query_start, context_lens=lengths.astype(np.int32), block_tables=local_tables,
            slot_mapping=local_slots, logits_rows=local_logits,
            max_query_len=int(np.max(ends[mine] - starts[mine])) if mine.size else 0,
            max_context_len=int(lengths.max()) if mine.size else 0,
            token_sources=np.zeros((0, 2), np.int32),  # already filled into token_ids by the runner
            request_ids=tuple(batch.request_ids[s] for s in mine) if batch.request_ids else (),
            kv_block_tables=(local_tables,) if batch.kv_block_tables else (),
            kv_slot_mappings=(local_slots,) if batch.kv_slot_mappings else (),
            state_slots=batch.state_slots[mine] if batch.state_slots.size else batch.state_slots,
            state_snapshots=_local_snapshots(batch.state_snapshots, mine))
        return LocalStep(local, mine, logits_owner, logits_index, counts)

    def gather_logits(self, step: LocalStep, logits: Any) -> Any:
        """Every rank's logits rows, in the global batch's order (on every rank)."""
        width = int(step.logits_counts.max()) if step.logits_counts.size else 0
        if width == 0:
            return logits
        padded = np.zeros((width, logits.shape[1]), dtype=logits.dtype)
        padded[: logits.shape[0]] = logits
        everyone = self.comm.all_gather(padded)  # [ranks * width, vocab]
        return everyone[step.logits_owner.astype(np.int64) * width + step.logits_index]


def _local_snapshots(snapshots: np.ndarray, mine: np.ndarray) -> np.ndarray:
    """The rows of ``ForwardBatch.state_snapshots`` of this rank's sequences, renumbered."""
    if not snapshots.size:
        return snapshots
    local_of = np.full(int(snapshots[:, 0].max()) + 1, -1, np.int64)
    known = mine[mine < local_of.size]
    local_of[known] = np.flatnonzero(mine < local_of.size)
    kept = snapshots[local_of[snapshots[:, 0]] >= 0]
    return np.column_stack([local_of[kept[:, 0]], kept[:, 1:]]).astype(np.int32).reshape(-1, 3)
