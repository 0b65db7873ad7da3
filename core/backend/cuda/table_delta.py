"""Which block-table entries of a graph's static batch changed since the last step (no CuPy).

A decode step of B sequences changes almost nothing in the ``[num_seqs, max_blocks]`` table a
CUDA graph reads: a sequence gets a new block every ``block_size`` tokens, and sequences join
or leave the batch now and then. ``TableMirror`` keeps the host copy of what the device holds
and turns each step's tables into the list of entries to write (flat index, value), so the
static batch sends those instead of the whole table (``B × max_blocks`` ids: 256 KiB at 256
sequences of 4k tokens). Rows past the batch and entries past a row's table hold the null
block 0, as a full restage would leave them.
"""

from __future__ import annotations

import numpy as np


class TableMirror:
    def __init__(self, num_seqs: int, max_blocks: int, max_changed_fraction: float = 0.25):
        self.table = np.zeros((num_seqs, max_blocks), np.int32)
        self.widths = np.zeros(num_seqs, np.int64)  # per row: entries past this are 0
        self.max_changed = max(1, int(num_seqs * max_blocks * max_changed_fraction))

    def update(self, tables: np.ndarray | None, num_rows: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Make the mirror hold ``tables`` (``[num_rows, width]``) null-padded. Returns the flat
        indices and values of the entries that changed, or None when so many changed that a
        full copy is cheaper (the mirror is updated either way)."""
        num_seqs, max_blocks = self.table.shape
        width = 0 if tables is None else tables.shape[1]
        if width > max_blocks or num_rows > num_seqs:
            raise ValueError(f"tables of {num_rows} x {width} do not fit the static batch's {num_seqs} x {max_blocks}")
        indices: list[np.ndarray] = []
        if num_rows and width:
            rows, cols = np.nonzero(self.table[:num_rows, :width] != tables[:num_rows])
            indices.append(rows.astype(np.int64) * max_blocks + cols)
        # stale entries: past the new width in the batch's rows, anywhere in the rows after it
        stale = np.flatnonzero(self.widths[:num_rows] > width)
        for row in stale:
            cols = np.flatnonzero(self.table[row, width:self.widths[row]]) + width
            indices.append(row * max_blocks + cols)
        for row in np.flatnonzero(self.widths[num_rows:]) + num_rows:
            indices.append(row * max_blocks + np.flatnonzero(self.table[row, :self.widths[row]]))
        if num_rows and width:
            self.table[:num_rows, :width] = tables[:num_rows]
        for row in stale:
            self.table[row, width:self.widths[row]] = 0
        if self.widths[num_rows:].any():
            self.table[num_rows:] = 0
        self.widths[:num_rows] = width
        self.widths[num_rows:] = 0
        flat = np.concatenate(indices) if indices else np.zeros(0, np.int64)
        if flat.size > self.max_changed:
            return None
        return flat.astype(np.int32), self.table.reshape(-1)[flat]
