"""A step's ForwardBatch on the GPU: every int32 array packed into one pinned host buffer and
sent with one host-to-device copy.

::

    pinned host / device buffer (int32), one section per field, in this order:
    [ token_ids T | positions T | slot_mapping T | query_start B+1 | context_lens B |
      block_tables B*max_blocks | logits_rows R | tile_seq N | tile_query N | state_slots B or 0 |
      (per KV cache group g, only with several groups) block table g B*max_blocks_g | slots g T ]

``tile_seq`` / ``tile_query`` list the prefill-attention tiles (128 queries of one sequence, in
``prefill_tiles``' launch order: most keys first, a mixed step's leading decodes last); decode
batches have none. A *static* batch (``StaticBatch``) keeps
one device buffer at fixed addresses for a CUDA graph: refilling it never moves a field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import cupy
import numpy as np

from openinfer.backend.base import BatchViews, ForwardBatch
from openinfer.backend.cuda.loader import kernel
from openinfer.backend.cuda.prefill_tiles import PREFILL_TILE, prefill_tiles
from openinfer.backend.cuda.table_delta import TableMirror

__all__ = ["PREFILL_TILE", "BatchUploader", "CudaBatch", "StaticBatch", "StaticPrefillBatch", "prefill_tiles"]


@dataclass
class CudaBatch(BatchViews):
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
    # the host copy of ``tile_seq`` as uploaded (eager batches; None for the static ones of graphs)
    host_tile_seq: np.ndarray | None = field(default=None, repr=False)
    state_slots: cupy.ndarray | None = None  # [B] each sequence's state slot (models with state)
    kv_block_tables: tuple[cupy.ndarray, ...] = ()  # per KV cache group (several groups only)
    kv_slot_mappings: tuple[cupy.ndarray, ...] = ()

    @property
    def num_tiles(self) -> int:
        return int(self.tile_seq.shape[0])


def _sections(batch: ForwardBatch, with_tiles: bool) -> list[np.ndarray]:
    tile_seq, tile_query = (prefill_tiles(batch.query_start) if with_tiles
                            else (np.zeros(0, np.int32), np.zeros(0, np.int32)))
    sections = [batch.token_ids, batch.positions, batch.slot_mapping, batch.query_start, batch.context_lens,
                batch.block_tables, batch.logits_rows, tile_seq, tile_query, batch.state_slots]
    for table, slots in zip(batch.kv_block_tables, batch.kv_slot_mappings, strict=True):
        sections += [table, slots]
    return sections


def _views(buffer: cupy.ndarray, sizes: list[int], num_seqs: int, widths: list[int]) -> list[cupy.ndarray]:
    """Views of the packed buffer; ``widths``: block-table widths (group 0 first, then any
    per-group tables), reshaped to ``[num_seqs, width]``."""
    views, offset = [], 0
    for size in sizes:
        views.append(buffer[offset:offset + size])
        offset += size
    table_sections = [5] + list(range(10, len(views), 2))
    for index, width in zip(table_sections, widths, strict=True):
        views[index] = views[index].reshape(num_seqs, width)
    return views


def _batch_from_views(views: list[cupy.ndarray], max_query_len: int, max_context_len: int,
                      host: ForwardBatch | None, with_state: bool) -> CudaBatch:
    return CudaBatch(*views[:9], max_query_len=max_query_len, max_context_len=max_context_len, host=host,
                     state_slots=views[9] if with_state else None,
                     kv_block_tables=tuple(views[10::2]), kv_slot_mappings=tuple(views[11::2]))


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

    def copy_parts(self, staging: np.ndarray, parts: list[tuple[int, int, cupy.ndarray]]) -> None:
        """``device[:count] = staging[start:start + count]`` for each ``(start, count, device)``,
        on the current stream, the staging buffer released after the last."""
        stream = cupy.cuda.get_current_stream()
        for start, count, device in parts:
            if count:
                device[:count].set(staging[start:start + count], stream=stream)
        self._copied.record(stream)

    def upload(self, batch: ForwardBatch) -> CudaBatch:
        sections = _sections(batch, with_tiles=not batch.is_decode)
        staging = self.stage(sections)
        device = cupy.empty(staging.size, dtype=cupy.int32)
        self.copy(staging, device)
        widths = [batch.block_tables.shape[1]] + [t.shape[1] for t in batch.kv_block_tables]
        views = _views(device, [int(s.size) for s in sections], batch.num_seqs, widths)
        uploaded = _batch_from_views(views, batch.max_query_len, batch.max_context_len, batch,
                                     batch.state_slots.shape[0] > 0)
        uploaded.host_tile_seq = sections[7]
        return uploaded


class StaticBatch:
    """A decode batch of exactly ``num_seqs`` sequences at fixed device addresses (CUDA graphs).

    ``fill`` pads a smaller decode batch: extra sequences get context length 0, slot -1 (no
    KV write), token 0 at position 0, block table rows of the null block and the null state
    slot 0. ``num_groups`` > 1 adds one table (``max_blocks_per_seq`` wide) and one slot
    mapping per KV cache group; ``with_state`` adds the state-slot section.

    With one KV cache group and no state, a step sends only the per-sequence sections (tokens,
    positions, slots, context lengths) and the block-table entries that changed since the
    last fill (``TableMirror``), scattered in place on the device; the table is copied whole
    only when most of it changed.
    """

    def __init__(self, uploader: BatchUploader, num_seqs: int, max_blocks_per_seq: int, num_groups: int = 1,
                 with_state: bool = False):
        self.uploader = uploader
        self.num_seqs = num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.num_groups = num_groups
        self.with_state = with_state
        group_sizes = [num_seqs * max_blocks_per_seq, num_seqs] * num_groups if num_groups > 1 else []
        self.sizes = [num_seqs, num_seqs, num_seqs, num_seqs + 1, num_seqs, num_seqs * max_blocks_per_seq,
                      num_seqs, 0, 0, num_seqs if with_state else 0, *group_sizes]
        self.buffer = cupy.zeros(sum(self.sizes), dtype=cupy.int32)
        widths = [max_blocks_per_seq] * (1 + (num_groups if num_groups > 1 else 0))
        views = _views(self.buffer, self.sizes, num_seqs, widths)
        self.batch = _batch_from_views(views, 1, 1, None, with_state)
        self._mirror: TableMirror | None = None
        self.num_table_entries_sent = 0  # block-table ids sent by fills since construction
        self.fill(None)  # in full: the fixed sections (query_start, logits_rows) are written only here
        if num_groups <= 1 and not with_state:  # the device table is all null now, as a new mirror
            self._mirror = TableMirror(num_seqs, max_blocks_per_seq)
            self._scatter = cupy.empty(2 * num_seqs * max_blocks_per_seq // 4 + 2, dtype=cupy.int32)

    def fill(self, batch: ForwardBatch | None) -> None:
        """Copy ``batch`` (a decode batch of at most ``num_seqs`` sequences) into the buffer."""
        n, b = self.num_seqs, 0 if batch is None else batch.num_seqs
        if batch is not None and not batch.is_decode:
            raise ValueError("a static (graph) batch holds decode steps only: one new token per sequence")
        if b > n:
            raise ValueError(f"batch of {b} sequences does not fit the static batch of {n}")
        if self._mirror is not None:
            delta = self._mirror.update(None if batch is None else batch.block_tables, b)
            if delta is not None:
                self._fill_rows_and_delta(batch, b, *delta)
                return
        token_ids, positions = np.zeros(n, np.int32), np.zeros(n, np.int32)
        context_lens = np.zeros(n, np.int32)
        state_slots = np.zeros(n if self.with_state else 0, np.int32)
        groups = self.num_groups if self.num_groups > 1 else 0
        if batch is not None and groups and len(batch.kv_block_tables) != groups:
            raise ValueError(f"the graph was captured for {groups} KV cache groups, the batch has "
                             f"{len(batch.kv_block_tables)}")
        tables = [self._padded_table(None if batch is None else batch.block_tables, b)]
        slots = [self._padded_slots(None if batch is None else batch.slot_mapping, b)]
        for g in range(groups):
            tables.append(self._padded_table(None if batch is None else batch.kv_block_tables[g], b))
            slots.append(self._padded_slots(None if batch is None else batch.kv_slot_mappings[g], b))
        if batch is not None:
            token_ids[:b], positions[:b], context_lens[:b] = batch.token_ids, batch.positions, batch.context_lens
            if self.with_state:
                state_slots[:b] = batch.state_slots
        sections = [token_ids, positions, slots[0], np.arange(n + 1, dtype=np.int32), context_lens, tables[0],
                    np.arange(n, dtype=np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32), state_slots]
        for g in range(groups):
            sections += [tables[g + 1], slots[g + 1]]
        staging = self.uploader.stage(sections)
        self.uploader.copy(staging, self.buffer)
        self.batch.max_context_len = 1 if batch is None else batch.max_context_len
        self.batch.host = batch
        self.num_table_entries_sent += tables[0].size

    def _fill_rows_and_delta(self, batch: ForwardBatch | None, b: int, index: np.ndarray, values: np.ndarray) -> None:
        """The per-sequence sections in full, the block table as ``table.flat[index] = values``."""
        n = self.num_seqs
        token_ids, positions = np.zeros(n, np.int32), np.zeros(n, np.int32)
        context_lens = np.zeros(n, np.int32)
        slots = self._padded_slots(None if batch is None else batch.slot_mapping, b)
        if batch is not None:
            token_ids[:b], positions[:b], context_lens[:b] = batch.token_ids, batch.positions, batch.context_lens
        count = int(index.size)
        head = [token_ids, positions, slots]  # sections 0-2, then query_start (fixed), context_lens
        staging = self.uploader.stage([*head, context_lens, index, values])
        parts = [(0, 3 * n, self.buffer), (3 * n, n, self.batch.context_lens)]
        if count:
            if 2 * count > self._scatter.size:
                self._scatter = cupy.empty(2 * count, dtype=cupy.int32)
            parts.append((4 * n, 2 * count, self._scatter))
        self.uploader.copy_parts(staging, parts)
        if count:
            kernel("static_batch.cu", "scatter_int32")(
                (min(1024, -(-count // 256)),), (256,),
                (self.batch.block_tables, self._scatter[:count], self._scatter[count:2 * count], np.int32(count)))
        self.batch.max_context_len = 1 if batch is None else batch.max_context_len
        self.batch.host = batch
        self.num_table_entries_sent += count

    def _padded_table(self, table: np.ndarray | None, b: int) -> np.ndarray:
        padded = np.zeros((self.num_seqs, self.max_blocks_per_seq), np.int32)
        if table is not None:
            width = table.shape[1]
            if width > self.max_blocks_per_seq:
                raise ValueError(f"block tables of {width} blocks exceed the graph's {self.max_blocks_per_seq}; "
                                 "raise max_model_len for the graph runner")
            padded[:b, :width] = table
        return padded

    def _padded_slots(self, slots: np.ndarray | None, b: int) -> np.ndarray:
        padded = np.full(self.num_seqs, -1, np.int32)
        if slots is not None:
            padded[:b] = slots
        return padded


class StaticPrefillBatch:
    """A short prefill step at fixed device addresses (CUDA graphs): at most ``num_seqs``
    sequences of at most ``max_query_len`` new tokens each, ``num_tokens`` tokens in all (a
    warm prefix's last block, riding along with decode rows).

    Every section has a fixed size: ``num_tokens`` tokens, ``num_seqs`` sequences, one prefill
    tile per sequence (``tile_seq = 0..num_seqs-1``, ``tile_query = 0``: a sequence's <= 16 new
    tokens fill one 128-query tile) and ``num_seqs`` logits rows. ``max_query_len`` is the
    capture's, so the short-query kernel's grid covers any step that fits. ``fill`` packs a
    smaller step at the front and pads: padded sequences have no tokens and context length 0;
    padded token rows belong to no sequence (token 0, position 0, slot -1: no KV write), so
    nothing reads them and their outputs are never sampled; padded logits rows read row 0.
    The block table goes as a delta (``TableMirror``) like ``StaticBatch``'s.
    """

    def __init__(self, uploader: BatchUploader, num_seqs: int, num_tokens: int, max_blocks_per_seq: int,
                 max_query_len: int):
        if num_tokens < num_seqs or max_query_len < 1:
            raise ValueError(f"a static prefill batch needs num_tokens >= num_seqs and max_query_len >= 1, got "
                             f"{num_tokens} tokens, {num_seqs} sequences, max_query_len {max_query_len}")
        self.uploader = uploader
        self.num_seqs, self.num_tokens = num_seqs, num_tokens
        self.max_blocks_per_seq, self.max_query_len = max_blocks_per_seq, max_query_len
        n, t = num_seqs, num_tokens
        self.sizes = [t, t, t, n + 1, n, n * max_blocks_per_seq, n, n, n, 0]
        self.buffer = cupy.zeros(sum(self.sizes), dtype=cupy.int32)
        views = _views(self.buffer, self.sizes, n, [max_blocks_per_seq])
        self.batch = _batch_from_views(views, max_query_len, 1, None, False)
        self._head = 3 * t + 2 * n + 1  # tokens, positions, slots, query_start, context_lens
        self._logits_offset = self._head + n * max_blocks_per_seq
        tiles = np.concatenate([np.arange(n, dtype=np.int32), np.zeros(n, np.int32)])
        self.buffer[self._logits_offset + n:] = cupy.asarray(tiles)
        self._mirror = TableMirror(n, max_blocks_per_seq)  # the device table is all null now
        self._scatter = cupy.empty(2 * n * max_blocks_per_seq // 4 + 2, dtype=cupy.int32)
        self.num_table_entries_sent = 0
        self.fill(None)

    def fits(self, batch: ForwardBatch) -> bool:
        return (batch.num_seqs <= self.num_seqs and batch.num_tokens <= self.num_tokens
                and batch.max_query_len <= self.max_query_len and batch.logits_rows.shape[0] <= self.num_seqs
                and batch.block_tables.shape[1] <= self.max_blocks_per_seq
                and not batch.kv_block_tables and not batch.state_slots.shape[0])

    def fill(self, batch: ForwardBatch | None) -> None:
        """Copy ``batch`` (a step that ``fits``) into the buffer, padded."""
        if batch is not None and not self.fits(batch):
            raise ValueError(f"a step of {batch.num_seqs} sequences, {batch.num_tokens} tokens (at most "
                             f"{batch.max_query_len} per sequence) does not fit the static prefill batch of "
                             f"{self.num_seqs} sequences, {self.num_tokens} tokens, {self.max_query_len} per sequence")
        n, t = self.num_seqs, self.num_tokens
        b = 0 if batch is None else batch.num_seqs
        k = 0 if batch is None else batch.num_tokens
        token_ids, positions, slots = np.zeros(t, np.int32), np.zeros(t, np.int32), np.full(t, -1, np.int32)
        query_start = np.full(n + 1, k, np.int32)
        context_lens, logits_rows = np.zeros(n, np.int32), np.zeros(n, np.int32)
        if batch is not None:
            token_ids[:k], positions[:k], slots[:k] = batch.token_ids, batch.positions, batch.slot_mapping
            query_start[:b + 1] = batch.query_start
            context_lens[:b] = batch.context_lens
            logits_rows[:batch.logits_rows.shape[0]] = batch.logits_rows
        head = [token_ids, positions, slots, query_start, context_lens]
        delta = self._mirror.update(None if batch is None else batch.block_tables, b)
        if delta is None:  # most of the table changed: every section up to the tiles in one copy
            table = np.zeros((n, self.max_blocks_per_seq), np.int32)
            if batch is not None:
                table[:b, :batch.block_tables.shape[1]] = batch.block_tables
            staging = self.uploader.stage([*head, table, logits_rows])
            self.uploader.copy(staging, self.buffer)
            self.num_table_entries_sent += table.size
        else:
            index, values = delta
            count = int(index.size)
            staging = self.uploader.stage([*head, logits_rows, index, values])
            parts = [(0, self._head, self.buffer), (self._head, n, self.batch.logits_rows)]
            if count:
                if 2 * count > self._scatter.size:
                    self._scatter = cupy.empty(2 * count, dtype=cupy.int32)
                parts.append((self._head + n, 2 * count, self._scatter))
            self.uploader.copy_parts(staging, parts)
            if count:
                kernel("static_batch.cu", "scatter_int32")(
                    (min(1024, -(-count // 256)),), (256,),
                    (self.batch.block_tables, self._scatter[:count], self._scatter[count:2 * count], np.int32(count)))
            self.num_table_entries_sent += count
        self.batch.max_context_len = 1 if batch is None else batch.max_context_len
        self.batch.host = batch
