"""A step's ForwardBatch on the GPU: every int32 array packed into one pinned host buffer and
sent with one host-to-device copy.

::

    pinned host / device buffer (int32), one section per field, in this order:
    [ token_ids T | positions T | slot_mapping T | query_start B+1 | context_lens B |
      block_tables B*max_blocks | logits_rows R | tile_seq N | tile_query N ]

``tile_seq`` / ``tile_query`` list the prefill-attention tiles (64 queries of one sequence,
longest-running first); decode batches have none. A *static* batch (``StaticBatch``) keeps
one device buffer at fixed addresses for a CUDA graph: refilling it never moves a field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import cupy
import numpy as np

from openinfer.backend.base import ForwardBatch

PREFILL_TILE = 64  # queries per prefill-attention tile (BLOCK_M in prefill_attention.cu)


@dataclass
class CudaBatch:
    """Same field names as ``ForwardBatch``; arrays are int32 device views, counts are host ints."""

    token_ids: cupy.ndarray
    positions: cupy.ndarray
    slot_mapping: cupy.ndarray
    query_start: cupy.ndarray
    context_lens: cupy.ndarray
    block_tables: cupy.ndarray
    logits_rows: cupy.ndarray
    tile_seq: cupy.ndarray
    tile_query: cupy.ndarray
    max_query_len: int
    max_context_len: int
    host: ForwardBatch | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    @property
    def num_tiles(self) -> int:
        return int(self.tile_seq.shape[0])

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1


def prefill_tiles(query_start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(tile_seq, tile_query) for every 64-query tile, tiles with the most keys first."""
    counts = np.diff(query_start)
    seqs = np.repeat(np.arange(counts.shape[0], dtype=np.int32), -(-counts // PREFILL_TILE))
    starts = np.concatenate([np.arange(0, n, PREFILL_TILE, dtype=np.int32) for n in counts]) \
        if counts.size else np.zeros(0, np.int32)
    order = np.argsort(-starts, kind="stable")
    return seqs[order].astype(np.int32), starts[order].astype(np.int32)


def _sections(batch: ForwardBatch, with_tiles: bool) -> list[np.ndarray]:
    tile_seq, tile_query = (prefill_tiles(batch.query_start) if with_tiles
                            else (np.zeros(0, np.int32), np.zeros(0, np.int32)))
    return [batch.token_ids, batch.positions, batch.slot_mapping, batch.query_start, batch.context_lens,
            batch.block_tables, batch.logits_rows, tile_seq, tile_query]


def _views(buffer: cupy.ndarray, sizes: list[int], num_seqs: int, max_blocks: int) -> list[cupy.ndarray]:
    views, offset = [], 0
    for size in sizes:
        views.append(buffer[offset:offset + size])
        offset += size
    views[5] = views[5].reshape(num_seqs, max_blocks)
    return views


class BatchUploader:
    """Owns the pinned staging buffer; ``upload`` makes a fresh device batch (eager steps)."""

    def __init__(self) -> None:
        self._pinned: np.ndarray = np.zeros(0, np.int32)
        self._pinned_memory = None
        self._copied = cupy.cuda.Event()

    def _staging(self, size: int) -> np.ndarray:
        if self._pinned.size < size:
            capacity = max(size, 2 * self._pinned.size, 4096)
            self._pinned_memory = cupy.cuda.alloc_pinned_memory(capacity * 4)
            self._pinned = np.frombuffer(self._pinned_memory, np.int32, capacity)
        self._copied.synchronize()  # the previous copy out of the staging buffer has finished
        return self._pinned[:size]

    def stage(self, sections: list[np.ndarray]) -> np.ndarray:
        sizes = [int(s.size) for s in sections]
        staging = self._staging(sum(sizes))
        offset = 0
        for section, size in zip(sections, sizes, strict=True):
            staging[offset:offset + size] = section.reshape(-1)
            offset += size
        return staging

    def copy(self, staging: np.ndarray, device: cupy.ndarray) -> None:
        stream = cupy.cuda.get_current_stream()
        device[:staging.size].set(staging, stream=stream)
        self._copied.record(stream)

    def upload(self, batch: ForwardBatch) -> CudaBatch:
        sections = _sections(batch, with_tiles=not batch.is_decode)
        staging = self.stage(sections)
        device = cupy.empty(staging.size, dtype=cupy.int32)
        self.copy(staging, device)
        views = _views(device, [int(s.size) for s in sections], batch.num_seqs, batch.block_tables.shape[1])
        return CudaBatch(*views, max_query_len=batch.max_query_len,
                         max_context_len=batch.max_context_len, host=batch)


class StaticBatch:
    """A decode batch of exactly ``num_seqs`` sequences at fixed device addresses (CUDA graphs).

    ``fill`` pads a smaller decode batch: extra sequences get context length 0, slot -1 (no
    KV write), token 0 at position 0 and block table rows of the null block.
    """

    def __init__(self, uploader: BatchUploader, num_seqs: int, max_blocks_per_seq: int):
        self.uploader = uploader
        self.num_seqs = num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.sizes = [num_seqs, num_seqs, num_seqs, num_seqs + 1, num_seqs, num_seqs * max_blocks_per_seq,
                      num_seqs, 0, 0]
        self.buffer = cupy.zeros(sum(self.sizes), dtype=cupy.int32)
        views = _views(self.buffer, self.sizes, num_seqs, max_blocks_per_seq)
        self.batch = CudaBatch(*views, max_query_len=1, max_context_len=1)
        self.fill(None)

    def fill(self, batch: ForwardBatch | None) -> None:
        """Copy ``batch`` (a decode batch of at most ``num_seqs`` sequences) into the buffer."""
        n, b = self.num_seqs, 0 if batch is None else batch.num_seqs
        if batch is not None and not batch.is_decode:
            raise ValueError("a static (graph) batch holds decode steps only: one new token per sequence")
        if b > n:
            raise ValueError(f"batch of {b} sequences does not fit the static batch of {n}")
        tables = np.zeros((n, self.max_blocks_per_seq), np.int32)
        token_ids, positions = np.zeros(n, np.int32), np.zeros(n, np.int32)
        slots, context_lens = np.full(n, -1, np.int32), np.zeros(n, np.int32)
        if batch is not None:
            width = batch.block_tables.shape[1]
            if width > self.max_blocks_per_seq:
                raise ValueError(f"block tables of {width} blocks exceed the graph's {self.max_blocks_per_seq}; "
                                 "raise max_model_len for the graph runner")
            tables[:b, :width] = batch.block_tables
            token_ids[:b], positions[:b] = batch.token_ids, batch.positions
            slots[:b], context_lens[:b] = batch.slot_mapping, batch.context_lens
        sections = [token_ids, positions, slots, np.arange(n + 1, dtype=np.int32), context_lens, tables,
                    np.arange(n, dtype=np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32)]
        staging = self.uploader.stage(sections)
        self.uploader.copy(staging, self.buffer)
        self.batch.max_context_len = 1 if batch is None else batch.max_context_len
        self.batch.host = batch
