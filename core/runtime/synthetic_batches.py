"""Synthetic steps laid out for an engine's KV cache groups and state slots: decode batches,
single prompts and mixed steps (the kernel ledger times them; the engine's start-up warm-up runs
them once so a first request compiles nothing)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

BLOCK_SIZE = 16


@dataclass(frozen=True)
class StepLayout:
    """What a step's batch carries for a model: token ids below ``vocab_size``, a flag per KV cache
    group (paged: block table and write slots; else a state group with neither) and whether
    sequences own state slots."""

    vocab_size: int = 1000
    paged_groups: tuple[bool, ...] = (True,)
    with_state: bool = False

    @classmethod
    def of(cls, engine: Any) -> StepLayout:
        groups = engine.kv_groups
        return cls(int(engine.model.spec.vocab_size), tuple(bool(g.paged) for g in groups.groups),
                   bool(groups.has_state))

    def token_ids(self, count: int, seed: int) -> np.ndarray:
        return np.random.default_rng(seed).integers(0, min(1000, self.vocab_size), count).astype(np.int32)


def _batch(token_ids: np.ndarray, positions: np.ndarray, query_start: np.ndarray, context_lens: np.ndarray,
           tables: np.ndarray, logits_rows: np.ndarray, layout: StepLayout) -> Any:
    """A ForwardBatch over ``tables`` (every paged group gets the same block ids: each group's
    pool has that many blocks) with state slots 1..B when the model keeps state."""
    from openinfer.backend.base import ForwardBatch

    seq_of_token = np.repeat(np.arange(len(context_lens)), np.diff(query_start))
    slots = (tables[seq_of_token, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE).astype(np.int32)
    num_seqs, num_tokens = len(context_lens), len(token_ids)
    group_tables = tuple(tables if paged else np.zeros((num_seqs, 0), np.int32) for paged in layout.paged_groups)
    group_slots = tuple(slots if paged else np.full(num_tokens, -1, np.int32) for paged in layout.paged_groups)
    several = len(layout.paged_groups) > 1
    return ForwardBatch(
        token_ids=token_ids, positions=positions, query_start=query_start, context_lens=context_lens,
        block_tables=tables, slot_mapping=slots, logits_rows=logits_rows,
        max_query_len=int(np.diff(query_start).max()), max_context_len=int(context_lens.max()),
        request_ids=tuple(f"ledger-{i}" for i in range(num_seqs)),
        kv_block_tables=group_tables if several else (), kv_slot_mappings=group_slots if several else (),
        state_slots=np.arange(1, num_seqs + 1, dtype=np.int32) if layout.with_state else np.zeros(0, np.int32))


def decode_batch(num_seqs: int, context: int, layout: StepLayout = StepLayout()) -> Any:
    """One new token per sequence at position ``context - 1``, each sequence its own blocks."""
    blocks = -(-context // BLOCK_SIZE)
    tables = (1 + np.arange(num_seqs * blocks, dtype=np.int32)).reshape(num_seqs, blocks)
    return _batch(layout.token_ids(num_seqs, num_seqs),
                  np.full(num_seqs, context - 1, np.int32), np.arange(num_seqs + 1, dtype=np.int32),
                  np.full(num_seqs, context, np.int32), tables, np.arange(num_seqs, dtype=np.int32), layout)


def prefill_batch(tokens: int, layout: StepLayout = StepLayout()) -> Any:
    """One sequence's whole prompt of ``tokens`` (its state, if any, starts fresh)."""
    blocks = -(-tokens // BLOCK_SIZE)
    return _batch(layout.token_ids(tokens, tokens),
                  np.arange(tokens, dtype=np.int32), np.array([0, tokens], np.int32), np.array([tokens], np.int32),
                  np.arange(1, blocks + 1, dtype=np.int32)[None, :], np.array([tokens - 1], np.int32), layout)




def step_batch(new_tokens: list[int], contexts: list[int], layout: StepLayout = StepLayout(), seed: int = 0) -> Any:
    """Sequence ``i`` brings ``new_tokens[i]`` tokens ending at ``contexts[i]`` (a decode: 1 and its
    context; a fresh prompt: its length twice), each sequence its own blocks from block 1 on."""
    new, context = np.asarray(new_tokens, np.int32), np.asarray(contexts, np.int32)
    if new.shape != context.shape or not new.size or (new < 1).any() or (new > context).any():
        raise ValueError(f"each sequence needs 1 <= new tokens <= context, got {new_tokens} / {contexts}")
    blocks = -(-context // BLOCK_SIZE)
    width = int(blocks.max())
    starts = 1 + np.concatenate(([0], np.cumsum(blocks)[:-1]))
    tables = np.zeros((len(new), width), np.int32)
    for row, (start, count) in enumerate(zip(starts, blocks, strict=True)):
        tables[row, :count] = np.arange(start, start + count, dtype=np.int32)
    query_start = np.concatenate(([0], np.cumsum(new))).astype(np.int32)
    positions = np.concatenate([np.arange(c - n, c, dtype=np.int32) for n, c in zip(new, context, strict=True)])
    return _batch(layout.token_ids(int(new.sum()), seed), positions, query_start, context, tables,
                  (query_start[1:] - 1).astype(np.int32), layout)


def blocks_needed(contexts: list[int]) -> int:
    """KV blocks a ``step_batch`` over these contexts uses (block ids 1..N)."""
    return int(sum(-(-int(c) // BLOCK_SIZE) for c in contexts))
