"""Running a model's ranks on threads with the fake communicator, and the step batches the
tensor/expert-parallel equivalence tests feed them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from openinfer.backend.base import ForwardBatch
from openinfer.backend.numpy_backend import NumpyBackend
from openinfer.parallel.fake import run_ranks
from openinfer.parallel.layout import ParallelLayout
from openinfer.parallel.rank import RankContext
from openinfer.runtime.model import kv_cache_specs_of

BLOCK_SIZE = 4


def prefill_then_decode(prompts: Sequence[Sequence[int]], next_tokens: Sequence[int],
                        request_ids: Sequence[str] | None = None) -> list[ForwardBatch]:
    """Two steps over paged KV: every prompt prefilled at once, then one decode token each.
    Sequence i owns blocks ``1 + i*8 ..`` (block 0 is the null block) and state slot ``1 + i``."""
    blocks_per_seq = 8
    tables = np.array([[1 + i * blocks_per_seq + b for b in range(blocks_per_seq)] for i in range(len(prompts))],
                      np.int32)
    ids = tuple(request_ids or (f"r{i}" for i in range(len(prompts))))

    def slot(seq: int, position: int) -> int:
        return int(tables[seq, position // BLOCK_SIZE]) * BLOCK_SIZE + position % BLOCK_SIZE

    lengths = [len(p) for p in prompts]
    state_slots = np.arange(1, len(prompts) + 1, dtype=np.int32)  # slot 0 is the null slot
    query_start = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    prefill = ForwardBatch(
        token_ids=np.concatenate([np.asarray(p, np.int32) for p in prompts]),
        positions=np.concatenate([np.arange(n, dtype=np.int32) for n in lengths]),
        query_start=query_start, context_lens=np.array(lengths, np.int32), block_tables=tables,
        slot_mapping=np.array([slot(i, j) for i, n in enumerate(lengths) for j in range(n)], np.int32),
        logits_rows=(query_start[1:] - 1).astype(np.int32), max_query_len=max(lengths),
        max_context_len=max(lengths), request_ids=ids, state_slots=state_slots)
    decode = ForwardBatch(
        token_ids=np.asarray(next_tokens, np.int32), positions=np.array(lengths, np.int32),
        query_start=np.arange(len(prompts) + 1, dtype=np.int32), context_lens=np.array(lengths, np.int32) + 1,
        block_tables=tables, slot_mapping=np.array([slot(i, n) for i, n in enumerate(lengths)], np.int32),
        logits_rows=np.arange(len(prompts), dtype=np.int32), max_query_len=1, max_context_len=max(lengths) + 1,
        request_ids=ids, state_slots=state_slots)
    return [prefill, decode]


def rank_logits(factory: Callable[[Any, RankContext], Any], layout: ParallelLayout,
                batches: Sequence[ForwardBatch]) -> list[list[np.ndarray]]:
    """Every rank's logits for each batch (rank-major), each rank a thread with its own shard."""

    def run_rank(comm: Any) -> list[np.ndarray]:
        backend = NumpyBackend()
        model = factory(backend, RankContext(layout=layout, rank=comm.rank, comm=comm))
        kv = [backend.allocate_kv(spec, 64 if spec.paged else 8, BLOCK_SIZE) for spec in kv_cache_specs_of(model)]
        return [np.array(model.forward(backend.prepare_batch(b), kv)) for b in batches]

    return run_ranks(layout.world_size, run_rank)
