"""DeepSeek-V4's caches as KV cache specs, and one sequence's view of a layer's caches.

Per layer, in ``kv_cache_specs()`` order (W = sliding_window, m = the layer's rate, D = head_dim,
DI = index_head_dim, c = 2 for CSA's overlapping [Ca | Cb] projections, else 1)::

    every layer   SlidingWindowSpec(1 head, D, K=V, window W)   the last W keys, blocks behind freed
    CSA / HCA     CompressedSpec(D, m)                          entry e = tokens [e·m, (e+1)·m)
    CSA           CompressedSpec(DI, 4)                         the indexer's own compressed keys
    CSA / HCA     RecurrentStateSpec                            the compressors' open windows:
                    kv, gate            [m, c·D]   wkv / wgate rows of the open window (n % m valid)
                    overlap_kv, _gate   [m, D]     CSA: Ca half of the last closed window (+ ape)
                    index_*             the same for the indexer's compressor at DI

Equal specs share a KV cache group (all sliding layers one, all CSA entries one, ...). The
open window is request state in an engine-owned slot: a chunked prefill or a decode step
continues it exactly where the previous step stopped, and the engine snapshots it at block
boundaries so a prefix-cache hit (whole compressed blocks, ``hit_granularity`` tokens)
restores it. A sequence starting at position 0 reads no state (its slot may hold a previous
owner's); ``num_rows`` and validity follow from the position alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from openinfer import (
    CompressedSpec,
    KVCacheSpec,
    RecurrentStateSpec,
    SlidingWindowSpec,
    StateTensor,
    group_specs,
)
from openinfer_deepseek_v4.config import CSA, SLIDING, DeepseekV4Config

COMPRESSOR = "compressor"
INDEXER = "indexer"
_STATE_PREFIX = {COMPRESSOR: "", INDEXER: "index_"}


@dataclass
class OpenWindow:
    """A compressor's partial-window state: pending projection rows and (CSA) the last closed
    window's Ca half, which the next entry pools too."""

    kv: np.ndarray  # [r, c·d], r < rate
    gate: np.ndarray  # [r, c·d] (without ape)
    overlap_kv: np.ndarray | None = None  # [rate, d]
    overlap_gate: np.ndarray | None = None  # [rate, d] (ape included)


@dataclass(frozen=True)
class LayerCacheIndex:
    """Where layer i's caches sit in ``kv_cache`` (and their KV cache groups); -1 when absent."""

    window: int
    window_group: int
    entries: int = -1
    entries_group: int = -1
    index_keys: int = -1
    index_keys_group: int = -1
    state: int = -1


def kv_cache_specs(config: DeepseekV4Config, dtype: str) -> tuple[list[KVCacheSpec], list[LayerCacheIndex]]:
    specs: list[KVCacheSpec] = []
    positions: list[dict[str, int]] = []
    window = SlidingWindowSpec(1, config.head_dim, dtype, shared_kv=True, window=config.sliding_window)
    for kind in config.layer_types:
        where = {"window": len(specs)}
        specs.append(window)
        if kind != SLIDING:
            rate = config.compress_rate(kind)
            width = (2 if kind == CSA else 1) * config.head_dim
            tensors = [StateTensor("kv", (rate, width), dtype), StateTensor("gate", (rate, width), dtype)]
            where["entries"] = len(specs)
            specs.append(CompressedSpec(config.head_dim, rate, dtype))
            if kind == CSA:
                index_width = 2 * config.index_head_dim
                where["index_keys"] = len(specs)
                specs.append(CompressedSpec(config.index_head_dim, rate, dtype))
                tensors += [StateTensor("overlap_kv", (rate, config.head_dim), dtype),
                            StateTensor("overlap_gate", (rate, config.head_dim), dtype),
                            StateTensor("index_kv", (rate, index_width), dtype),
                            StateTensor("index_gate", (rate, index_width), dtype),
                            StateTensor("index_overlap_kv", (rate, config.index_head_dim), dtype),
                            StateTensor("index_overlap_gate", (rate, config.index_head_dim), dtype)]
            where["state"] = len(specs)
            specs.append(RecurrentStateSpec(tuple(tensors)))
        positions.append(where)
    group_of = group_specs(specs).group_of_layer
    index = [LayerCacheIndex(
        window=p["window"], window_group=group_of[p["window"]],
        entries=p.get("entries", -1), entries_group=group_of[p["entries"]] if "entries" in p else -1,
        index_keys=p.get("index_keys", -1),
        index_keys_group=group_of[p["index_keys"]] if "index_keys" in p else -1,
        state=p.get("state", -1)) for p in positions]
    return specs, index


def _addresses(table: np.ndarray, indices: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    indices = np.asarray(indices, np.int64)
    return np.asarray(table)[indices // block_size], indices % block_size


class SequenceLayerCache:
    """One sequence's view of one layer's caches in a step: its new tokens are at positions
    ``start … start + n - 1``; reads and writes go through the batch's block tables and slot."""

    def __init__(self, kv_cache: list[Any], where: LayerCacheIndex, batch: Any, seq: int, start: int):
        self.kv_cache, self.where, self.batch, self.seq, self.start = kv_cache, where, batch, seq, start
        self.window_cache = kv_cache[where.window].k  # [blocks, block_size, 1, D]
        self.block_size = self.window_cache.shape[1]
        self.slot = int(batch.state_slots[seq]) if where.state >= 0 else 0

    def _table(self, group: int) -> np.ndarray:
        return self.batch.group_block_tables(group)[self.seq]

    # --- sliding window -------------------------------------------------------------------------

    def past_keys(self, window: int) -> np.ndarray:
        """Keys of positions ``max(0, start - window + 1) … start - 1``."""
        first = max(0, self.start - window + 1)
        blocks, offsets = _addresses(self._table(self.where.window_group), np.arange(first, self.start),
                                     self.block_size)
        return self.window_cache[blocks, offsets, 0]

    def write_keys(self, keys: np.ndarray) -> None:
        positions = np.arange(self.start, self.start + keys.shape[0])
        blocks, offsets = _addresses(self._table(self.where.window_group), positions, self.block_size)
        self.window_cache[blocks, offsets, 0] = keys

    # --- compressed entries ---------------------------------------------------------------------

    def _entries_cache(self, which: str) -> tuple[Any, int]:
        if which == COMPRESSOR:
            return self.kv_cache[self.where.entries].k, self.where.entries_group
        return self.kv_cache[self.where.index_keys].k, self.where.index_keys_group

    def entries(self, which: str, count: int) -> np.ndarray:
        cache, group = self._entries_cache(which)
        blocks, offsets = _addresses(self._table(group), np.arange(count), cache.shape[1])
        return cache[blocks, offsets]

    def write_entries(self, which: str, first: int, entries: np.ndarray) -> None:
        cache, group = self._entries_cache(which)
        blocks, offsets = _addresses(self._table(group), np.arange(first, first + entries.shape[0]), cache.shape[1])
        cache[blocks, offsets] = entries

    # --- the compressors' open windows (state slot) --------------------------------------------

    def open_window(self, which: str, rate: int, overlap: bool) -> OpenWindow:
        state, prefix = self.kv_cache[self.where.state], _STATE_PREFIX[which]
        rows = self.start % rate
        window = OpenWindow(np.array(state[prefix + "kv"][self.slot, :rows]),
                            np.array(state[prefix + "gate"][self.slot, :rows]))
        if overlap and self.start >= rate:  # a window closed before: its Ca half is kept
            window.overlap_kv = np.array(state[prefix + "overlap_kv"][self.slot])
            window.overlap_gate = np.array(state[prefix + "overlap_gate"][self.slot])
        return window

    def store_open_window(self, which: str, window: OpenWindow) -> None:
        state, prefix = self.kv_cache[self.where.state], _STATE_PREFIX[which]
        rows = window.kv.shape[0]
        state[prefix + "kv"][self.slot, :rows] = window.kv
        state[prefix + "gate"][self.slot, :rows] = window.gate
        if window.overlap_kv is not None:
            state[prefix + "overlap_kv"][self.slot] = window.overlap_kv
            state[prefix + "overlap_gate"][self.slot] = window.overlap_gate
